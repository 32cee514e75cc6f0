"""`eagle` / `eagle3` speculation: an EAGLE head (model/eagle.py) drafts greedily from the target's
own features, k tokens in k passes batched over the speculating requests.

The target's runner keeps each step's rows of the features (`ModelRunner.capture`: the final hidden
states, or EAGLE-3's three residual streams) with their (request, position); the pipeline hands
them here (`observe`). A proposal feeds the head, for every position the target computed since the
last one, the target's feature there and the next token's embedding (EAGLE's shift: position j
reads token j + 1), writing the head's KV from the target's features (`fed`); the head's last row
gives the first draft token, and each next pass reads the head's own output for the position
before (its KV past `fed` is written over at the next proposal, from the target's features then).

The head's KV lives in the target's KV space (draft_kv.py). Positions the target did not compute
(a prefix-cache hit, the prompt of an `n` > 1 request's samples) have no feature: the head reads
zeros there (drafts are still verified; fewer are kept). Not yet: tensor parallelism (the head
reads the target's whole embedding and LM head), CUDA graphs while a head drafts (turned off)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from treeserve.engine.kv_space import KVSpace
from treeserve.engine.loaded_model import LoadedModel
from treeserve.engine.request import Request
from treeserve.engine.spec_decode.draft_kv import (MAX_CATCH_UP, DraftKV, DraftSequence, PassDrafter, flat_order,
                                                   pass_inputs)
from treeserve.errors import ParamError
from treeserve.model.eagle import check_eagle_checkpoint, load_eagle_head, read_eagle_config
from treeserve.model.registry import resolve_model_path
from treeserve.model.transfer import to_device
from treeserve.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class FedSequence(DraftSequence):
    """`fed`: positions whose head KV was written from the target's features; `features`: the
    target's rows for positions not fed yet, as (a step's captured rows, row)."""
    fed: int = 0
    features: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)


class EagleProposer(PassDrafter):
    """Reads the head's config.json when the engine starts (its shape against the target's); loads
    its weights at the first draft."""

    def __init__(self, config: SpeculativeConfig, target: LoadedModel, space: KVSpace):
        if target.executor is not None:
            raise ParamError("speculative_config", f"method {config.method!r} with tensor parallelism is not "
                             "supported yet (the head reads the target's whole embedding and LM head)")
        self.config, self.target, self.space = config, target, space
        self.path = resolve_model_path(config.model)
        self.head_config = read_eagle_config(self.path, config.method, target.model_config)
        check_eagle_checkpoint(self.path, self.head_config)
        block_size = space.arena.block_size_for(self.head_config.layer, target.dtype)
        if block_size < 1:
            raise ParamError("speculative_config", f"the {config.method} head needs more KV bytes per token than one "
                             f"of the target's KV pages holds ({space.arena.page_bytes} bytes)")
        super().__init__(DraftKV(space, f"{target.model_key}:{config.method}", block_size, FedSequence))
        self.capture = "aux" if config.method == "eagle3" else "final"  # what the target's runner keeps
        if config.method == "eagle3":
            target.model.aux_layers = self.head_config.aux_layers
        self.head = None  # its weights, at the first draft
        self.kv_cache = None
        self.vocab_size = target.model_config.vocab_size

    def _load(self) -> None:
        target = self.target
        self.head = load_eagle_head(self.path, self.head_config, target.model, target.max_model_len, target.dtype,
                                    target.device)
        self.kv_cache = self.space.arena.layer_views(self.head_config.layer, target.dtype)[0]
        logger.info("%s head %s loaded (%d tokens per KV page)", self.config.method, self.path.name, self.kv.block_size)

    # ---- the pipeline's and Speculator's side ---------------------------------------------
    def observe(self, rows: torch.Tensor, keys: list[tuple[str, int]], requests: dict[str, Request]) -> None:
        """A step's captured rows: each request that drafts with this head keeps a copy of its own
        (one gather for the step; at most MAX_CATCH_UP positions wait, older ones read as zeros)."""
        config, mine = self.config, {}
        for row, (request_id, position) in enumerate(keys):
            request = requests.get(request_id)
            if request is not None and request.speculative_config == config:
                mine.setdefault(request_id, []).append((row, position))
        if not mine:
            return
        index = [row for picked in mine.values() for row, _ in picked]
        gathered = rows[to_device(torch.tensor(index), rows.device)]
        start = 0
        for request_id, picked in mine.items():
            own = gathered[start:start + len(picked)].clone()  # (a view would keep every request's rows alive)
            start += len(picked)
            features = self.kv.sequence(request_id).features
            for i, (_, position) in enumerate(picked):
                features[position] = (own, i)
            while len(features) > MAX_CATCH_UP:
                del features[next(iter(features))]

    def verified(self, request: Request, num_accepted: int) -> None:
        """The rows of rejected drafts had their features captured: they go (a later step that
        computes those positions may run without capture, which must leave them unknown, not stale)."""
        sequence = self.kv.sequences.get(request.request_id)
        if sequence is not None:
            last = request.num_computed_tokens + num_accepted  # (the last known token's row and the kept drafts')
            for position in [p for p in sequence.features if p > last]:
                del sequence.features[position]

    def propose_all(self, wanted: list[tuple[Request, int, float]]) -> list[list[int]]:
        """Up to k draft tokens for each (request, k, threshold): a catch-up pass, then one pass per
        further draft token (greedy: no threshold cuts it)."""
        if self.head is None:
            self._load()
        drafts: dict[str, list[int]] = {request.request_id: [] for request, _, _ in wanted}
        live = self._catch_up_rows(wanted)  # (request, k, first position, input tokens, features)
        if not live:
            return [[] for _ in wanted]
        with torch.inference_mode():
            tokens, features = self._pass(live)
            for step in range(max((row[1] for row in live), default=0)):
                for (request, k, *_), token in zip(live, tokens):
                    if k > step:
                        drafts[request.request_id].append(token)
                kept = [i for i, row in enumerate(live) if row[1] > step + 1]
                if not kept:
                    break
                # draft token step + 1 at the position after the fed ones, the head's feature before it
                live = [(live[i][0], live[i][1], self.kv.sequences[live[i][0].request_id].fed + step, [tokens[i]],
                         features[i:i + 1]) for i in kept]
                tokens, features = self._pass(live)
        return [drafts[request.request_id] for request, _, _ in wanted]

    # ---- the passes -----------------------------------------------------------------------
    def _catch_up_rows(self, wanted):
        """Per request that may draft: (request, k, the first position the target computed since
        the last proposal, the input tokens of those positions, their features), with room for the
        drafts' KV."""
        rows = []
        for request, k, _ in wanted:
            sequence = self.kv.sequence(request.request_id)
            computed = request.num_computed_tokens
            start = min(sequence.fed, computed - 1)  # (nothing new: the last position is fed again)
            end = min(computed, start + MAX_CATCH_UP)
            k = k if end == computed else 0
            k = min(k, self.target.max_model_len - request.num_tokens)
            if k < 0 or not self.kv.hold(sequence, end + max(k - 1, 0), reserve=len(wanted)):
                self.kv.drop(request.request_id)
                continue
            tokens = request.all_token_ids[start + 1:end + 1]
            rows.append((request, k, start, tokens, self._features(sequence, start, end)))
            sequence.fed = end
            last = sequence.features.get(end - 1)
            sequence.features = {end - 1: last} if last is not None else {}
        return rows

    def _features(self, sequence: FedSequence, start: int, end: int) -> torch.Tensor:
        """The target's rows for positions [start, end), in the head's feature space; zeros where
        the target computed none (a cached prefix)."""
        found = [sequence.features.get(p) for p in range(start, end)]
        width = self.head_config.feature_size // 2 if self.config.method == "eagle" else self.head_config.feature_size
        out = torch.zeros(end - start, width, dtype=self.target.dtype, device=self.target.device)
        by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for i, item in enumerate(found):
            if item is not None:
                tensor, row = item
                entry = by_tensor.setdefault(id(tensor), (tensor, [], []))
                entry[1].append(i)
                entry[2].append(row)
        for tensor, at, rows in by_tensor.values():
            out[to_device(torch.tensor(at), out.device)] = tensor[to_device(torch.tensor(rows), out.device)].to(out.dtype)
        return self.head.target_features(out)

    def _pass(self, rows) -> tuple[list[int], torch.Tensor]:
        """One forward of the head over each row's tokens (and features) from its first position;
        the greedy next token and the head's feature at each row's last position, in the given order."""
        started = time.perf_counter()
        chunks = [(self.kv.sequences[request.request_id].blocks, first, len(tokens), request.num_prompt_tokens)
                  for request, _, first, tokens, _ in rows]
        device, backend = self.target.device, self.target.model.backend
        inputs = pass_inputs(backend, self.head.rotary, self.kv.block_size, device, chunks)
        order = flat_order(chunks)
        token_ids = torch.tensor([t for i in order for t in rows[i][3]], dtype=torch.long)
        features = torch.cat([rows[i][4] for i in order])
        hidden, next_features = self.head(to_device(token_ids, device), features, inputs.positions, self.kv_cache,
                                          inputs.meta, backend)
        last = to_device(torch.tensor(inputs.last_rows), device)
        tokens = self.head.greedy_tokens(hidden[last], self.vocab_size).tolist()
        if len(token_ids) == len(rows):
            self.pass_costs.observe(time.perf_counter() - started, len(rows))
        return tokens, next_features[last]
