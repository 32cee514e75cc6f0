"""A speculating request's verified positions as the sampler sees decode rows.

Row j of a request's k + 1 verification rows samples the token after draft j - 1: to the sampler's
logits processing (penalties, bad_words, min_tokens: `Sampler.process_logits`) its output so far is
the request's output followed by drafts[:j], as it would be had plain decoding emitted those drafts
(vLLM's rejection sampler likewise appends each row's earlier drafts to the output it penalizes)."""
from __future__ import annotations

from treeserve.engine.input_batch import CachedRequestState


class DraftRow:
    """The request's state with the drafts before this row appended to its output (read-only, but
    for the allowed_token_ids mask kept with the request: token_masks.py builds it once). The
    penalties read `state`'s histories once for all its rows, then each row's `drafts` (sampler.py)."""

    __slots__ = ("state", "drafts", "num_output_tokens")

    def __init__(self, state: CachedRequestState, drafts: list[int]):
        self.state, self.drafts = state, drafts
        self.num_output_tokens = state.num_output_tokens + len(drafts)

    @property
    def sampling_params(self):
        return self.state.sampling_params

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.state.eos_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.state.output_token_ids + self.drafts

    @property
    def allowed_mask(self):
        return self.state.allowed_mask

    @allowed_mask.setter
    def allowed_mask(self, mask) -> None:
        self.state.allowed_mask = mask


def draft_rows(rows: list[tuple[CachedRequestState, list[int]]]) -> list[DraftRow]:
    """Every verification row of `rows` (each request's k + 1, in order)."""
    return [DraftRow(state, drafts[:j]) for state, drafts in rows for j in range(len(drafts) + 1)]
