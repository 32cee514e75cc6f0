"""Prompt log-probabilities (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`).

The logits at prompt position p give the log-probability of prompt token p + 1. They are computed
in the prefill steps that compute the positions, a slice of rows at a time, so at most
`SLICE_ELEMENTS` full-vocabulary logits exist at once whatever the prompt's length; each position
keeps only its own token's log-probability and rank and the top k. A prompt's first token has none.

A prefix-cache hit would skip the positions whose log-probabilities are asked for, so a request
with `prompt_logprobs` computes its whole prompt (as vLLM does): it finds no cached prefix, and
the blocks it computes are cached for the requests after it.
"""
from __future__ import annotations

from typing import Callable

import torch

from treeserve.engine.input_batch import CachedRequestState

SLICE_ELEMENTS = 1 << 22  # logits held at once: 16 MiB of float32

Entry = dict[int, tuple[float, int]]  # token id -> (logprob, rank)


def rows_for(request: CachedRequestState, first_pos: int, count: int, first_row: int) -> list[tuple[CachedRequestState, int, int]]:
    """(request, position, row) for the positions of this chunk whose next prompt token is known."""
    targets = request.prompt_logprob_ids
    if targets is None:
        return []
    end = min(first_pos + count, len(targets) - 1)
    return [(request, pos, first_row + pos - first_pos) for pos in range(first_pos, end)]


def compute(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            rows: list[tuple[CachedRequestState, int, int]], vocab_size: int) -> list[tuple[CachedRequestState, int, Entry]]:
    """Each row's next prompt token: (request, position + 1, {token: (logprob, rank)}) with the top k."""
    out = []
    step = max(1, SLICE_ELEMENTS // max(vocab_size, 1))
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        index = torch.tensor([row for _, _, row in part], device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)
        targets = torch.tensor([r.prompt_logprob_ids[pos + 1] for r, pos, _ in part], device=hidden.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(dim=1) + 1
        k = max(r.sampling_params.prompt_logprobs for r, _, _ in part)
        top_lp, top_ids = logprobs.topk(k, dim=1) if k else (None, None)
        out.extend(_entries(part, targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_lp, top_ids))
    return out


def _entries(part, targets, chosen, ranks, top_lp, top_ids) -> list[tuple[CachedRequestState, int, Entry]]:
    out = []
    lps, ids = (top_lp.tolist(), top_ids.tolist()) if top_lp is not None else (None, None)
    for i, (request, pos, _) in enumerate(part):
        entry = {targets[i]: (chosen[i], ranks[i])}
        for rank in range(request.sampling_params.prompt_logprobs):
            entry.setdefault(ids[i][rank], (lps[i][rank], rank + 1))
        out.append((request, pos + 1, entry))
    return out
