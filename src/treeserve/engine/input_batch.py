"""The model runner's own view of the requests it serves, kept up to date from each `StepData`.

The runner never sees the scheduler's `Request` objects: it holds, per request id, the tokens, the
block table, how many tokens are computed, the sampling settings and a seeded request's numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.engine.block_table import BlockTable
from treeserve.engine.seeded_draws import SeededDraws
from treeserve.engine.step_data import NewRequestData, StepData
from treeserve.engine.token_masks import uses_token_masks
from treeserve.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    prefill_only: bool
    logits_positions: list[int] | None
    readout_token_ids: list[int] | None
    prompt_logprob_ids: list[int] | None
    seeded_draws: SeededDraws | None = None  # a seeded request's uniform numbers by output position
    table_row: int = -1  # its row of the batch's `BlockTable` (the same ids as `block_ids`)
    allowed_mask: torch.Tensor | None = None  # allowed_token_ids: what they leave out (engine/token_masks.py)

    @classmethod
    def from_new(cls, new: NewRequestData) -> "CachedRequestState":
        return cls(new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                   new.num_computed_tokens, new.params, tuple(new.eos_token_ids), new.prefill_only,
                   new.logits_positions, new.readout_token_ids, new.prompt_logprob_ids,
                   SeededDraws.of(new.params.seed))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def recent_output(self, count: int) -> list[int]:
        """The last `count` output tokens (fewer if it has fewer)."""
        return self.token_ids[max(self.num_prompt_tokens, len(self.token_ids) - count):]


class InputBatch:
    """The requests by id, and their block tables both as lists (`CachedRequestState.block_ids`) and
    as rows of one array (`block_table`, for attention metadata built by gathering rows)."""

    def __init__(self):
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable()
        self.num_masked = 0  # requests with allowed_token_ids or bad_words: the sampler masks their rows

    def update(self, step: StepData) -> None:
        for req_id in step.finished_req_ids:
            self._remove(req_id)
        for new in step.new_requests:
            self._remove(new.req_id)  # (a request id sent anew replaces what was held under it)
            state = CachedRequestState.from_new(new)
            state.table_row = self.block_table.add(state.block_ids)
            self.requests[new.req_id] = state
            self.num_masked += uses_token_masks(state.sampling_params)
        for cached in step.cached_requests:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            del state.block_ids[cached.block_ids_from:]
            state.block_ids.extend(cached.new_block_ids)
            self.block_table.write(state.table_row, cached.block_ids_from, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.remove(state.table_row)
            self.num_masked -= uses_token_masks(state.sampling_params)

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.requests[req_id]

    def __len__(self) -> int:
        return len(self.requests)
