"""A speculating request's verified positions as the sampler sees decode rows.

Row j of a request's k + 1 verification rows samples the token after draft j - 1: to the sampler's
logits processing (penalties, bad_words, min_tokens: `Sampler.process_logits`) its output so far is
the request's output followed by drafts[:j], as it would be had plain decoding emitted those drafts
(vLLM's rejection sampler likewise appends each row's earlier drafts to the output it penalizes)."""
from __future__ import annotations

from treeserve.engine.input_batch import CachedRequestState
from treeserve.engine.sampler import min_tokens_stops
from treeserve.engine.token_masks import banned_tokens, recent_output


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

    def recent_output(self, count: int) -> list[int]:
        """The last `count` tokens of this row's output (bad words' prefixes), the request's history
        not copied."""
        if count <= len(self.drafts):
            return self.drafts[len(self.drafts) - count:]
        return self.state.recent_output(count - len(self.drafts)) + self.drafts

    @property
    def allowed_mask(self):
        return self.state.allowed_mask

    @allowed_mask.setter
    def allowed_mask(self, mask) -> None:
        self.state.allowed_mask = mask


def draft_rows(rows: list[tuple[CachedRequestState, list[int]]]) -> list[DraftRow]:
    """Every verification row of `rows` (each request's k + 1, in order)."""
    return [DraftRow(state, drafts[:j]) for state, drafts in rows for j in range(len(drafts) + 1)]


def permitted_drafts(request, drafts: list[int]) -> list[int]:
    """The drafts before the first one its row's processing forbids: a token outside
    allowed_token_ids, the last token of a bad word whose prefix ends the output and drafts before it,
    or a stop (EOS, stop_token_ids) while fewer than min_tokens come before it. Its row masks it, so
    it is never kept and every draft after it would be verified for nothing; its row is verified
    still, and emits what plain decoding would (`request`: the engine's, its output current)."""
    p = request.sampling_params
    below_min = request.num_output_tokens < p.min_tokens
    if not (request.allowed_token_set or p.bad_words_token_ids or below_min):
        return drafts
    stops = set(min_tokens_stops(request)) if below_min else set()
    tail = recent_output(request, p.bad_words_token_ids) if p.bad_words_token_ids else []
    ends = {seq[-1] for seq in p.bad_words_token_ids}  # (a draft that ends no bad word is not banned)
    for j, draft in enumerate(drafts):
        if ((request.allowed_token_set is not None and draft not in request.allowed_token_set)
                or (request.num_output_tokens + j < p.min_tokens and draft in stops)
                or (draft in ends and draft in banned_tokens(tail + drafts[:j], p.bad_words_token_ids))):
            return drafts[:j]
    return drafts
