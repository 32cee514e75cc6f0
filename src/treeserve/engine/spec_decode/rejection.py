"""Verifying a step's drafts against the model's own distribution at each of their positions.

A request's k drafts and its last known token run as k + 1 query rows; row i holds the model's
logits for the token after draft i - 1. Greedy: drafts are kept while each equals the model's
argmax, then the argmax after the last kept one is appended (the tokens plain decoding would
have produced). Sampling: every row samples its token as plain decoding would (inverse transform
of one uniform number), and a draft is kept while it equals its row's sample; the first row whose
sample differs emits that sample, and after k kept drafts the last row's sample is the bonus token.
A draft proposed with certainty (every proposer's drafts are) is then kept with probability p(draft),
as in speculative sampling, and each emitted token is its row's sample: exactly the model's
distribution given the tokens before it. The uniform numbers do not depend on the drafts, so a
seeded request (whose number for its k-th output token is its seed's k-th: sampler.SeededDraws)
emits the very tokens it would without speculation.

A grammar's mask (structured outputs: at each row, what the grammar allows after the drafts before
it), then the sampler's own logits processing (`Sampler.process_logits`: allowed_token_ids,
bad_words, logit bias, min_tokens' stops, penalties), temperature, top-k, top-p and min-p apply per
row as in the sampler, each row's output so far being the request's followed by the drafts before
it (draft_rows.py): penalties count those drafts, a bad word's prefix may end in them, and EOS and
stop tokens stay masked while fewer than min_tokens would come before. A constrained request's
drafts stop where its grammar would refuse one."""
from __future__ import annotations

import torch

from treeserve.engine import structured_outputs
from treeserve.engine.input_batch import CachedRequestState
from treeserve.engine.sampler import Sampler, _filter, _inverse_transform, _on, changes_logits
from treeserve.engine.spec_decode.draft_rows import draft_rows

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
    if any(changes_logits(state) for state, _ in rows):  # (else no row's logits change: no row views to build)
        logits = Sampler.process_logits(logits, draft_rows(rows))
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
    """The sampling requests' tokens, batched: every row's own sample (its uniform number: a seeded
    request's keyed by the position it samples), then per request the drafts kept while they equal
    their rows' samples, and the sample of the row after the last kept one."""
    temperature = _on(logits.device, [1.0 if p.greedy else p.temperature for p in params])
    row_ids = [firsts[i] + j for i in sampled for j in range(len(rows[i][1]) + 1)]
    draws = [u for i in sampled for u in _uniforms(rows[i][0], len(rows[i][1]) + 1)]
    chosen = _on(logits.device, row_ids)
    probs = torch.softmax(_filter(logits[chosen] / temperature[chosen, None], [params[r] for r in row_ids]), dim=-1)
    samples = _inverse_transform(probs, _on(probs.device, draws, torch.float64)).tolist()
    at = 0
    for i in sampled:
        drafts = rows[i][1]
        kept = 0
        while kept < len(drafts) and drafts[kept] == samples[at + kept]:
            kept += 1
        tokens[i] = drafts[:kept] + [samples[at + kept]]
        at += len(drafts) + 1


def _uniforms(state: CachedRequestState, count: int) -> list[float]:
    """The uniform numbers of a request's `count` rows: row j samples the token at position
    num_computed_tokens + 1 + j (a seeded request's number is its seed's for that output position,
    as the sampler's)."""
    if state.seeded_draws is None:
        return torch.rand(count, dtype=torch.float64).tolist()
    first = state.num_computed_tokens + 1 - state.num_prompt_tokens
    return [state.seeded_draws.at(first + j) for j in range(count)]


def _logprobs(row: torch.Tensor, token: int, wanted: int) -> dict[int, tuple[float, int]]:
    """The sampler's entry for one row: the token's logprob and rank, then the `wanted` most likely."""
    chosen = float(row[token])
    entry = {token: (chosen, int((row > chosen).sum()) + 1)}
    if wanted:
        top_lp, top_ids = row.topk(wanted)
        for rank, (lp, tid) in enumerate(zip(top_lp.tolist(), top_ids.tolist()), start=1):
            entry.setdefault(tid, (lp, rank))
    return entry
