"""Verifying a step's drafts against the model's own distribution at each of their positions.

A request's k drafts and its last known token run as k + 1 query rows; row i holds the model's
logits for the token after draft i - 1. Greedy: drafts are kept while each equals the model's
argmax, then the argmax after the last kept one is appended (the tokens plain decoding would
have produced). Sampling: a draft proposed with certainty (n-gram drafts have no distribution of
their own) is kept with probability p(draft); a rejected one is replaced by a draw from p with
the draft's probability removed, renormalized; after k kept drafts a bonus token is drawn from
the last row. Each emitted token then has exactly the model's distribution given the tokens
before it: P(t) = p(d)[t = d] + (1 - p(d)) p(t) / (1 - p(d)) [t != d] = p(t).

A grammar's mask (structured outputs: at each row, what the grammar allows after the drafts before
it), logit bias, temperature, top-k, top-p and min-p apply per row as in the sampler; requests with
penalties or min_tokens still to reach get no drafts (engine/spec_decode/speculator.py), and a
constrained request's drafts stop where its grammar would refuse one.
A seeded request draws from its own generator (its tokens are reproducible, though not those of a
run without speculation)."""
from __future__ import annotations

import torch

from treeserve.engine import structured_outputs
from treeserve.engine.input_batch import CachedRequestState
from treeserve.engine.sampler import Sampler, _filter, _inverse_transform, _on

Emitted = list[tuple[int, dict | None]]


def verify(logits: torch.Tensor, rows: list[tuple[CachedRequestState, list[int]]],
           grammar_bitmasks: dict[str, torch.Tensor] | None = None) -> dict[str, Emitted]:
    """`logits`: each request's k + 1 rows in `rows` order; `grammar_bitmasks`: a constrained
    request's grammar at each of its rows (by request id). Returns, per request id, the tokens it
    emits with their logprobs (None unless asked for)."""
    params = [state.sampling_params for state, drafts in rows for _ in range(len(drafts) + 1)]
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    firsts = _first_rows(rows)
    _apply_grammars(logits, rows, firsts, grammar_bitmasks or {})
    Sampler._add_logit_bias(logits, params)
    greedy = [i for i, (state, _) in enumerate(rows) if state.sampling_params.greedy]
    sampled = [i for i, (state, _) in enumerate(rows) if not state.sampling_params.greedy]
    tokens: list[list[int]] = [[] for _ in rows]
    if greedy:
        targets = logits.argmax(dim=-1).tolist()
        for i in greedy:
            drafts = rows[i][1]
            tokens[i] = _greedy(drafts, targets[firsts[i]:firsts[i] + len(drafts) + 1])
    if sampled:
        _rejection(logits, params, rows, firsts, sampled, tokens)
    emitted: dict[str, Emitted] = {}
    for i, (state, _) in enumerate(rows):
        wanted = state.sampling_params.logprobs
        emitted[state.request_id] = [
            (t, None if raw is None or wanted is None else _logprobs(raw[firsts[i] + j], t, wanted))
            for j, t in enumerate(tokens[i])]
    return emitted


def _apply_grammars(logits, rows, firsts, bitmasks: dict[str, torch.Tensor]) -> None:
    """What each constrained request's grammar forbids at each of its rows, masked out (as the
    sampler masks a constrained row)."""
    masked = [(firsts[i], bitmasks[state.request_id]) for i, (state, _) in enumerate(rows)
              if state.request_id in bitmasks]
    if masked:
        indices = [first + j for first, mask in masked for j in range(mask.shape[0])]
        structured_outputs.apply_bitmask(logits, indices, torch.cat([mask for _, mask in masked]))


def _first_rows(rows) -> list[int]:
    firsts, first = [], 0
    for _, drafts in rows:
        firsts.append(first)
        first += len(drafts) + 1
    return firsts


def _greedy(drafts: list[int], targets: list[int]) -> list[int]:
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return drafts[:kept] + [targets[kept]]


def _rejection(logits, params, rows, firsts, sampled: list[int], tokens: list[list[int]]) -> None:
    """The sampling requests' tokens, batched: each draft kept while a uniform draw falls under its
    probability; then one draw per request from the row after its last kept draft (with a rejected
    draft's probability removed)."""
    temperature = _on(logits.device, [1.0 if p.greedy else p.temperature for p in params])
    probs = torch.softmax(_filter(logits / temperature[:, None], params), dim=-1)
    draft_rows = [firsts[i] + j for i in sampled for j in range(len(rows[i][1]))]
    draft_ids = [t for i in sampled for t in rows[i][1]]
    p_draft = probs[_on(probs.device, draft_rows), _on(probs.device, draft_ids)].tolist() if draft_rows else []
    final_rows, removed, draws = [], [], []
    at = 0
    for i in sampled:
        state, drafts = rows[i]
        uniforms = _uniforms(len(drafts) + 1, state.generator)
        kept = 0
        while kept < len(drafts) and (uniforms[kept] < p_draft[at + kept] or p_draft[at + kept] >= 1.0):
            kept += 1
        at += len(drafts)
        tokens[i] = drafts[:kept]
        final_rows.append(firsts[i] + kept)
        removed.append(drafts[kept] if kept < len(drafts) else -1)
        draws.append(uniforms[-1])
    final = probs[_on(probs.device, final_rows)]
    rejected = [(r, t) for r, t in enumerate(removed) if t >= 0]
    if rejected:
        final[_on(probs.device, [r for r, _ in rejected]), _on(probs.device, [t for _, t in rejected])] = 0
    drawn = _inverse_transform(final, _on(probs.device, draws, torch.float64)).tolist()
    for i, token in zip(sampled, drawn):
        tokens[i].append(token)


def _uniforms(count: int, generator: torch.Generator | None) -> list[float]:
    """`count` draws in [0, 1): a seeded request's from its own generator (reproducible)."""
    return torch.rand(count, dtype=torch.float64, generator=generator).tolist()


def _logprobs(row: torch.Tensor, token: int, wanted: int) -> dict[int, tuple[float, int]]:
    """The sampler's entry for one row: the token's logprob and rank, then the `wanted` most likely."""
    chosen = float(row[token])
    entry = {token: (chosen, int((row > chosen).sum()) + 1)}
    if wanted:
        top_lp, top_ids = row.topk(wanted)
        for rank, (lp, tid) in enumerate(zip(top_lp.tolist(), top_ids.tolist()), start=1):
            entry.setdefault(tid, (lp, rank))
    return entry
