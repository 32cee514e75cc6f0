"""`draft_model` speculation: a smaller model with the target's tokenizer writes each request's
draft greedily, k tokens in k passes batched over the speculating requests.

The draft model's KV lives in the target's KV space (its arena's pages, the same block pool, as
its own owner), one block table per request. Each proposal first feeds the draft model what the
target accepted since the last one (its KV is kept for the tokens both agree on: the longest
common prefix of what it wrote and the request's tokens), then drafts. Draft KV is the first thing
given back: for requests that stop running, and all of it whenever the target's scheduler runs
short of blocks (`release`), before any kept sequence or running request. The draft runs on this
process alone, also under tensor parallelism (it only proposes; the target verifies).

Not yet: prefix caching of the draft's KV (each sibling of a search prefills its prompt anew);
the draft's own weights are loaded after a `Runtime` sized its KV space (not counted in it)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from treeserve.config import EngineConfig
from treeserve.engine.block_pool import KVBlock
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.loaded_model import LoadedModel, describe_model, load_weights
from treeserve.engine.request import Request
from treeserve.engine.spec_decode.step_costs import PassCosts
from treeserve.errors import ParamError
from treeserve.model.loader import load_tokenizer
from treeserve.model.registry import resolve_model_path
from treeserve.model.transfer import to_device
from treeserve.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

MAX_CATCH_UP = 2048  # tokens one request feeds the draft model in one proposal (a longer prompt: in chunks, no draft)


@dataclass
class DraftSequence:
    """One request's draft KV: `blocks`, and the tokens whose KV they hold (`written`), of which
    the first `confirmed` are the request's own (the rest: drafts, kept as far as they were accepted)."""
    blocks: list[KVBlock] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    confirmed: int = 0


class DraftModelProposer:
    """Checks the draft checkpoint when the engine starts (its tokenizer, its KV per token against
    the target's pages); loads its weights at the first draft (an engine whose requests never
    speculate, a Runtime's PRM, never holds them)."""

    def __init__(self, config: SpeculativeConfig, target: LoadedModel, space: KVSpace):
        self.config, self.space, self.pool = config, space, space.pool
        self.owner = f"{target.model_key}:draft"
        self.draft = _describe_draft(config, target)
        self.dtype = target.dtype
        self.block_size = space.arena.block_size_for(self.draft.model_config, target.dtype)
        if self.block_size < 1:
            raise ParamError("speculative_config", f"the draft model {config.model!r} needs more KV bytes per token "
                             f"than one of the target's KV pages holds ({space.arena.page_bytes} bytes)")
        self.model = None  # its weights, at the first draft
        self.kv_caches: list = []
        self.pool.add_owner(self.owner)
        self.sequences: dict[str, DraftSequence] = {}
        self.max_model_len = min(target.max_model_len, self.draft.max_model_len)
        self.vocab_size = target.model_config.vocab_size  # (a draft's padded vocabulary may be wider)
        self.pass_costs = PassCosts()  # seconds per draft token, from its passes over decode rows only

    def _load(self) -> None:
        self.model = load_weights(self.draft).model
        self.kv_caches = self.space.arena.layer_views(self.model.kv_config, self.dtype)
        logger.info("draft model %s loaded (%d layers; %d tokens per KV page)", self.draft.model_dir.name,
                    self.draft.model_config.num_layers, self.block_size)

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
            tokens = self._pass(live, first=True)
            for step in range(max((k for _, k, _ in live), default=0)):
                for (request, k, _), token in zip(live, tokens):
                    if k > step:  # (a long prompt's chunk drafts nothing)
                        drafts[request.request_id].append(token)
                live = [(r, k, [token]) for (r, k, _), token in zip(live, tokens) if k > step + 1]
                if not live:
                    break
                tokens = self._pass(live, first=False)
        return [drafts[request.request_id] for request, _, _ in wanted]

    def retain(self, running: list[Request]) -> None:
        """The draft KV of requests no longer running goes back to the pool."""
        if self.sequences:
            live = {r.request_id for r in running}
            for request_id in [rid for rid in self.sequences if rid not in live]:
                self._drop(request_id)

    def release(self) -> bool:
        """Every draft block back to the pool (the target runs short); whether any was held."""
        held = bool(self.sequences)
        for request_id in list(self.sequences):
            self._drop(request_id)
        return held

    # ---- the passes -----------------------------------------------------------------------
    def _catch_up_rows(self, wanted: list[tuple[Request, int, float]]) -> list[tuple[Request, int, list[int]]]:
        """Per request that may draft: the tokens the draft model has not seen yet (at least its last
        one), with room for its drafts' KV; requests without room (blocks, length) draft nothing."""
        rows = []
        for request, k, _ in wanted:
            tokens = request.all_token_ids
            sequence = self.sequences.setdefault(request.request_id, DraftSequence())
            kept = _common_prefix(sequence, tokens)
            del sequence.written[kept:]
            new = tokens[kept:kept + MAX_CATCH_UP]
            sequence.confirmed = kept + len(new)
            k = k if sequence.confirmed == len(tokens) else 0  # a long prompt's chunk: no draft yet
            k = min(k, self.max_model_len - len(tokens))
            if k < 0 or not self._hold(sequence, kept + len(new) + max(k - 1, 0), reserve=len(wanted)):
                self._drop(request.request_id)  # (beyond the draft model's length, or no blocks to spare)
                continue
            rows.append((request, k, new))
        return rows

    def _pass(self, rows: list[tuple[Request, int, list[int]]], first: bool) -> list[int]:
        """One forward of the draft model over each row's new tokens (decode rows first, as the
        attention metadata wants); the greedy next token of each row, in the given order."""
        started = time.perf_counter()
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][2]) > 1)
        builder = self.model.backend.metadata_builder(self.block_size, self.draft.device)
        token_ids, positions, slots, last_rows = [], [], [], [0] * len(rows)
        bs, rope_positions = self.block_size, self.model.rotary.rope_positions
        for i in order:
            request, _, new = rows[i]
            sequence = self.sequences[request.request_id]
            first_pos, start_row = len(sequence.written), len(token_ids)
            context_len = first_pos + len(new)
            table = [b.block_id for b in sequence.blocks[:-(-context_len // bs)]]
            pos = torch.arange(first_pos, context_len, dtype=torch.long)
            token_ids.extend(new)
            positions.append(rope_positions(request.num_prompt_tokens, pos))
            slots.append(torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs)
            if len(new) == 1:
                builder.add_decode(context_len, table)
            else:
                builder.add_prefill(start_row, context_len, len(new), table)
            sequence.written.extend(new)
            last_rows[i] = len(token_ids) - 1
        device = self.draft.device
        meta = builder.build(to_device(torch.cat(slots), device))
        hidden = self.model(to_device(torch.tensor(token_ids, dtype=torch.long), device),
                            to_device(torch.cat(positions), device), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[to_device(torch.tensor(last_rows), device)])
        tokens = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        if len(token_ids) == len(rows):  # (a catch-up of many tokens is a prefill, not what a draft token costs)
            self.pass_costs.observe(time.perf_counter() - started, len(rows))
        return tokens

    # ---- blocks ---------------------------------------------------------------------------
    def _hold(self, sequence: DraftSequence, num_tokens: int, reserve: int) -> bool:
        """Blocks for `num_tokens` positions, taken only while `reserve` blocks stay free for the
        target's own requests."""
        needed = -(-num_tokens // self.block_size) - len(sequence.blocks)
        if needed <= 0:
            return True
        if self.pool.num_free - needed < reserve:
            return False
        sequence.blocks.extend(self.pool.allocate(needed, self.owner))
        return True

    def _drop(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.pool.free(reversed(sequence.blocks))


def _describe_draft(config: SpeculativeConfig, target: LoadedModel) -> LoadedModel:
    """The draft checkpoint for the target's device and dtype; its tokenizer must be the target's
    (the same token ids mean the same text)."""
    draft = describe_model(EngineConfig(model=config.model, dtype=target.dtype, device=str(target.device),
                                        seed=target.config.seed), name=f"{target.model_key}:draft")
    if not shares_tokenizer(draft.tokenizer, target):
        raise ParamError("speculative_config", f"the draft model {config.model!r} has another tokenizer than "
                         f"the target {target.model_dir.name!r}: a draft must share the target's vocabulary")
    return draft


def shares_tokenizer(tokenizer, target: LoadedModel) -> bool:
    return tokenizer.get_vocab() == target.tokenizer.get_vocab()


def draft_tokenizer(config: SpeculativeConfig):
    """The tokenizer of a configuration's draft checkpoint."""
    return load_tokenizer(resolve_model_path(config.model))


def _common_prefix(sequence: DraftSequence, tokens: list[int]) -> int:
    """How many leading tokens of what the draft model wrote are the request's (short of its last
    token, always fed again: its logits give the first draft token). Only the drafts past
    `confirmed` are compared."""
    written, n = sequence.written, min(len(sequence.written), len(tokens) - 1)
    for i in range(min(sequence.confirmed, n), n):
        if written[i] != tokens[i]:
            return i
    return n
