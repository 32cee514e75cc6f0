"""`draft_model` speculation: a smaller model with the target's tokenizer writes each request's
draft greedily, k tokens in k passes batched over the speculating requests.

The draft model's KV lives in the target's KV space (draft_kv.py). Each proposal first feeds the
draft model what the target accepted since the last one (its KV is kept for the tokens both agree
on: the longest common prefix of what it wrote and the request's tokens), then drafts. The draft
runs on this process alone, also under tensor parallelism (it only proposes; the target verifies).

Not yet: prefix caching of the draft's KV (each sibling of a search prefills its prompt anew);
the draft's own weights are loaded after a `Runtime` sized its KV space (not counted in it)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from treeserve.config import EngineConfig
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.loaded_model import LoadedModel, describe_model, load_weights
from treeserve.engine.request import Request
from treeserve.engine.spec_decode.draft_kv import (MAX_CATCH_UP, DraftKV, DraftSequence, PassDrafter, flat_order,
                                                   pass_inputs)
from treeserve.errors import ParamError
from treeserve.model.checkpoint_files import checkpoint_tensor_names
from treeserve.model.registry import resolve_model_path
from treeserve.model.tokenizer import load_tokenizer
from treeserve.model.transfer import to_device
from treeserve.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class WrittenSequence(DraftSequence):
    """The tokens whose KV the blocks hold (`written`), of which the first `confirmed` are the
    request's own (the rest: drafts, kept as far as they were accepted)."""
    written: list[int] = field(default_factory=list)
    confirmed: int = 0


class DraftModelProposer(PassDrafter):
    """Checks the draft checkpoint when the engine starts (its tokenizer, its KV per token against
    the target's pages); loads its weights at the first draft (an engine whose requests never
    speculate, a Runtime's PRM, never holds them)."""

    def __init__(self, config: SpeculativeConfig, target: LoadedModel, space: KVSpace):
        self.config, self.space = config, space
        self.draft = _describe_draft(config, target)
        self.dtype = target.dtype
        block_size = space.arena.block_size_for(self.draft.model_config, target.dtype)
        if block_size < 1:
            raise ParamError("speculative_config", f"the draft model {config.model!r} needs more KV bytes per token "
                             f"than one of the target's KV pages holds ({space.arena.page_bytes} bytes)")
        super().__init__(DraftKV(space, f"{target.model_key}:draft", block_size, WrittenSequence))
        self.model = None  # its weights, at the first draft
        self.kv_caches: list = []
        self.max_model_len = min(target.max_model_len, self.draft.max_model_len)
        self.vocab_size = target.model_config.vocab_size  # (a draft's padded vocabulary may be wider)

    def _load(self) -> None:
        self.model = load_weights(self.draft).model
        self.kv_caches = self.space.arena.layer_views(self.model.kv_config, self.dtype)
        logger.info("draft model %s loaded (%d layers; %d tokens per KV page)", self.draft.model_dir.name,
                    self.draft.model_config.num_layers, self.kv.block_size)

    def close(self) -> None:
        """Frees the draft's weights (its own: loaded by this proposer) and lets go of its KV views."""
        self.draft.release_weights()
        self.model, self.kv_caches = None, []

    # ---- the Speculator's side ------------------------------------------------------------
    def propose_all(self, wanted: list[tuple[Request, int, float]]) -> list[list[int]]:
        """Up to k draft tokens for each (request, k, threshold): k passes of the draft model over
        them all (the draft is greedy: no threshold cuts it)."""
        if self.model is None:
            self._load()
        drafts: dict[str, list[int]] = {request.request_id: [] for request, _, _ in wanted}
        live = self._catch_up_rows(wanted)
        if not live:
            return [[] for _ in wanted]
        with torch.inference_mode():
            tokens = self._pass(live)
            for step in range(max((k for _, k, _ in live), default=0)):
                for (request, k, _), token in zip(live, tokens):
                    if k > step:  # (a long prompt's chunk drafts nothing)
                        drafts[request.request_id].append(token)
                live = [(r, k, [token]) for (r, k, _), token in zip(live, tokens) if k > step + 1]
                if not live:
                    break
                tokens = self._pass(live)
        return [drafts[request.request_id] for request, _, _ in wanted]

    # ---- the passes -----------------------------------------------------------------------
    def _catch_up_rows(self, wanted: list[tuple[Request, int, float]]) -> list[tuple[Request, int, list[int]]]:
        """Per request that may draft: the tokens the draft model has not seen yet (at least its last
        one), with room for its drafts' KV; requests without room (blocks, length) draft nothing."""
        rows = []
        for request, k, _ in wanted:
            tokens = request.all_token_ids
            sequence = self.kv.sequence(request.request_id)
            kept = _common_prefix(sequence, tokens)
            del sequence.written[kept:]
            new = tokens[kept:kept + MAX_CATCH_UP]
            sequence.confirmed = kept + len(new)
            k = k if sequence.confirmed == len(tokens) else 0  # a long prompt's chunk: no draft yet
            k = min(k, self.max_model_len - len(tokens))
            if k < 0 or not self.kv.hold(sequence, kept + len(new) + max(k - 1, 0), reserve=len(wanted)):
                self.kv.drop(request.request_id)  # (beyond the draft model's length, or no blocks to spare)
                continue
            rows.append((request, k, new))
        return rows

    def _pass(self, rows: list[tuple[Request, int, list[int]]]) -> list[int]:
        """One forward of the draft model over each row's new tokens; the greedy next token of each
        row, in the given order."""
        started = time.perf_counter()
        sequences = [self.kv.sequences[request.request_id] for request, _, _ in rows]
        chunks = [(s.blocks, len(s.written), len(new), request.num_prompt_tokens)
                  for s, (request, _, new) in zip(sequences, rows)]
        device = self.draft.device
        inputs = pass_inputs(self.model.backend, self.model.rotary, self.kv.block_size, device, chunks)
        token_ids = [token for i in flat_order(chunks) for token in rows[i][2]]
        for sequence, (_, _, new) in zip(sequences, rows):
            sequence.written.extend(new)
        hidden = self.model(to_device(torch.tensor(token_ids, dtype=torch.long), device), inputs.positions,
                            self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden[to_device(torch.tensor(inputs.last_rows), device)])
        tokens = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        if len(token_ids) == len(rows):  # (a catch-up of many tokens is a prefill, not what a draft token costs)
            self.pass_costs.observe(time.perf_counter() - started, len(rows))
        return tokens


def _describe_draft(config: SpeculativeConfig, target: LoadedModel) -> LoadedModel:
    """The draft checkpoint for the target's device and dtype; its tokenizer must be the target's
    (the same token ids mean the same text)."""
    try:
        draft = describe_model(EngineConfig(model=config.model, dtype=target.dtype, device=str(target.device),
                                            seed=target.config.seed), name=f"{target.model_key}:draft")
        checkpoint_tensor_names(draft.model_dir)  # its weights load at the first draft: found now, at start
    except OSError as exc:  # (a folder or weights file missing: said at start, not by the first request)
        raise ParamError("speculative_config", f"the draft model {config.model!r} cannot be loaded: {exc}") from exc
    if not shares_tokenizer(draft.tokenizer, target):
        raise ParamError("speculative_config", f"the draft model {config.model!r} has another tokenizer than "
                         f"the target {target.model_dir.name!r}: a draft must share the target's vocabulary")
    return draft


def shares_tokenizer(tokenizer, target: LoadedModel) -> bool:
    return tokenizer.get_vocab() == target.tokenizer.get_vocab()


def draft_tokenizer(config: SpeculativeConfig):
    """The tokenizer of a configuration's draft checkpoint."""
    return load_tokenizer(resolve_model_path(config.model))


def _common_prefix(sequence: WrittenSequence, tokens: list[int]) -> int:
    """How many leading tokens of what the draft model wrote are the request's (short of its last
    token, always fed again: its logits give the first draft token). Only the drafts past
    `confirmed` are compared."""
    written, n = sequence.written, min(len(sequence.written), len(tokens) - 1)
    for i in range(min(sequence.confirmed, n), n):
        if written[i] != tokens[i]:
            return i
    return n
