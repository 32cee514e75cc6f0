"""Turns a step's logits into next tokens: grammar masks (structured outputs), allowed tokens and
bad words (engine/token_masks.py), logit bias, penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

All filtering is batched over the rows. A row samples by inverse transform: one uniform draw
against its cumulative probabilities. A request with its own seed draws the number for its k-th
output token as the k-th number of its seed's generator (`SeededDraws`), so a seeded request samples
the same tokens whatever else shares its batch, across preemptions, and with or without speculative
decoding (the verification draws each position's number alike: engine/spec_decode/rejection.py).

Nothing here waits on the device row by row: decisions come from the requests' parameters (host
data), and the sampled ids with every asked logprob reach the host in one copy per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.engine import structured_outputs
from treeserve.engine.input_batch import CachedRequestState
from treeserve.engine.token_masks import apply_token_masks, uses_token_masks
from treeserve.model.transfer import HostCopy, to_device


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None]  # token -> (logprob, rank), per row


class PendingSamples:
    """A step's sampled ids (and logprobs) on their way to the host; `result()` waits for them."""

    def __init__(self, token_ids: torch.Tensor, logprobs, requests: list[CachedRequestState]):
        self.token_ids = token_ids  # on the device: the next step's inputs may take them there (async scheduling)
        parts = [token_ids] + (list(logprobs[1:]) if logprobs is not None else [])
        self._copy, self._logprobs, self._requests = HostCopy(parts), logprobs, requests

    def result(self) -> SamplerOutput:
        return _unpack(self._copy.tolist(), self._logprobs, self._requests)


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[CachedRequestState]) -> SamplerOutput:
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests: list[CachedRequestState], grammar_rows: list[int] = (),
                     grammar_bitmask: torch.Tensor | None = None, masked: bool | None = None) -> PendingSamples:
        """Samples on the device; the copy to the host is started, not waited for. `grammar_bitmask`
        row j holds what the grammar of row `grammar_rows[j]` allows (structured outputs). `masked`:
        whether any row has allowed_token_ids or bad_words (the runner's batch counts them; None: look)."""
        params = [r.sampling_params for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        if grammar_bitmask is not None:
            structured_outputs.apply_bitmask(logits, list(grammar_rows), grammar_bitmask)
        logits = self.process_logits(logits, requests, masked)
        token_ids = self._pick(logits, requests)
        return PendingSamples(token_ids, _logprob_tensors(raw_logprobs, token_ids, requests), requests)

    @classmethod
    def process_logits(cls, logits, requests, masked: bool | None = None) -> torch.Tensor:
        """What each row's parameters do to its logits before temperature and top-k/top-p/min-p:
        allowed_token_ids and bad_words, logit bias, min_tokens' stops, penalties (in place where it
        can). A row reads its request's `sampling_params`, `output_token_ids`, `num_output_tokens`,
        `prompt_token_ids` and `eos_token_ids`: the verification of drafts passes one view per
        verified position, whose output holds the drafts before it (engine/spec_decode/draft_rows.py;
        the penalties count its request's histories once, `state`, and its own `drafts`)."""
        if masked if masked is not None else any(uses_token_masks(r.sampling_params) for r in requests):
            apply_token_masks(logits, requests)
        cls._add_logit_bias(logits, [r.sampling_params for r in requests])
        logits = cls._mask_stops_below_min_tokens(logits, requests)
        return cls._apply_penalties(logits, requests)

    @staticmethod
    def _add_logit_bias(logits, params) -> None:
        for row, p in enumerate(params):
            if p.logit_bias:
                ids = _on(logits.device, list(p.logit_bias))
                logits[row, ids] += _on(logits.device, list(p.logit_bias.values()), logits.dtype)

    @staticmethod
    def _mask_stops_below_min_tokens(logits, requests):
        for row, request in enumerate(requests):
            p = request.sampling_params
            if request.num_output_tokens < p.min_tokens:
                stops = min_tokens_stops(request)
                if stops:
                    # index_fill_ takes the value as a scalar: assigning a float through an index copies
                    # it to the device from pageable memory, which waits for the device
                    logits[row].index_fill_(0, _on(logits.device, stops), float("-inf"))
        return logits

    @staticmethod
    def _apply_penalties(logits, requests):
        """Only the penalized rows read their histories (a verified step's rows each carry the whole
        output and prompt: building them for every row of a batch where one request is penalized
        cost more than the step's other host work); the other rows are left as they are."""
        rows = [row for row, r in enumerate(requests) if penalized(r.sampling_params)]
        if len(rows) == len(requests):
            return _penalize(logits, requests)
        if not rows:
            return logits
        index = _on(logits.device, rows)
        return logits.index_copy(0, index, _penalize(logits.index_select(0, index), [requests[row] for row in rows]))

    def _pick(self, logits, requests):
        params = [r.sampling_params for r in requests]
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):
            return logits.argmax(dim=-1)
        temperatures = [1.0 if p.greedy else p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):  # (dividing by 1 changes nothing: a search samples at 1)
            logits = logits / _on(logits.device, temperatures)[:, None]
        probs = torch.softmax(_filter(logits, params), dim=-1)
        sampled = _inverse_transform(probs, _uniform_draws(requests, probs.device))
        if not any(greedy_rows):  # (an argmax over the whole vocabulary, for no row)
            return sampled
        return torch.where(to_device(torch.tensor(greedy_rows), logits.device), logits.argmax(dim=-1), sampled)


def changes_logits(request) -> bool:
    """Whether `Sampler.process_logits` changes any of the request's rows (its masks, bias, stops
    below min_tokens or penalties apply)."""
    p = request.sampling_params
    return bool(uses_token_masks(p) or p.logit_bias or penalized(p) or request.num_output_tokens < p.min_tokens)


def min_tokens_stops(request) -> list[int]:
    """The tokens a row masks while its output is shorter than min_tokens: its stop_token_ids and,
    unless it ignores EOS, its EOS tokens."""
    p = request.sampling_params
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))


def penalized(params) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def _penalize(logits, requests):
    """Presence and frequency penalties on the output's counts, the repetition penalty on every token
    of the prompt or the output (vLLM's rules), for rows that all read their histories."""
    params = [r.sampling_params for r in requests]
    device, vocab = logits.device, logits.shape[1]
    owners, index = _owners(requests)
    counts = _rows_of(_token_counts([o.output_token_ids for o in owners], vocab, device), index, len(owners))
    tails = [getattr(r, "drafts", ()) for r in requests]
    if any(tails):
        counts += _token_counts(tails, vocab, device)
    presence = _on(device, [p.presence_penalty for p in params])[:, None]
    frequency = _on(device, [p.frequency_penalty for p in params])[:, None]
    logits = logits - frequency * counts - presence * (counts > 0)
    if any(p.repetition_penalty != 1 for p in params):
        repetition = _on(device, [p.repetition_penalty for p in params])[:, None]
        prompts = _token_counts([o.prompt_token_ids for o in owners], vocab, device)
        seen = (counts + _rows_of(prompts, index, len(owners))) > 0
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    return logits


def _owners(requests) -> tuple[list, list[int]]:
    """The requests whose histories the rows read, each once, and each row's among them: a verified
    row (engine/spec_decode/draft_rows.py) reads its request's (`state`), then its own `drafts`."""
    owners, index, seen = [], [], {}
    for r in requests:
        owner = getattr(r, "state", r)
        at = seen.setdefault(id(owner), len(owners))
        if at == len(owners):
            owners.append(owner)
        index.append(at)
    return owners, index


def _rows_of(counts: torch.Tensor, index: list[int], num_owners: int) -> torch.Tensor:
    """Each row's counts from its owner's (as they are when every row is its own owner)."""
    return counts if len(index) == num_owners else counts.index_select(0, _on(counts.device, index))


def _logprob_tensors(raw_logprobs, token_ids, requests):
    """For the rows that asked for logprobs: (rows, chosen token's logprob, its rank, top-k logprobs,
    top-k ids), on the device, k the largest asked; None if no row asked."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return None
    index = to_device(torch.tensor(rows), raw_logprobs.device)
    lp = raw_logprobs.index_select(0, index)
    chosen_lp = lp.gather(1, token_ids.index_select(0, index)[:, None]).squeeze(1)
    ranks = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(max(requests[i].sampling_params.logprobs for i in rows))
    return rows, chosen_lp, ranks, top_lp, top_ids


def _unpack(host: list[float], logprobs, requests: list[CachedRequestState]) -> SamplerOutput:
    """The host copy's values back into token ids and per-row logprob entries."""
    batch = len(requests)
    tokens = [int(t) for t in host[:batch]]
    out: list[dict[int, tuple[float, int]] | None] = [None] * batch
    if logprobs is not None:
        rows, k = logprobs[0], logprobs[3].shape[1]
        count = len(rows)
        chosen_lp, ranks = host[batch:batch + count], host[batch + count:batch + 2 * count]
        top_lp, top_ids = host[batch + 2 * count:batch + 2 * count + count * k], host[batch + 2 * count + count * k:]
        for i, row in enumerate(rows):
            entry = {tokens[row]: (chosen_lp[i], int(ranks[i]))}
            wanted = requests[row].sampling_params.logprobs
            for rank in range(1, wanted + 1):
                entry.setdefault(int(top_ids[i * k + rank - 1]), (top_lp[i * k + rank - 1], rank))
            out[row] = entry
    return SamplerOutput(tokens, out)


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts.scatter_add_(1, to_device(padded, device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Applies top-k, top-p and min-p by masking logits to -inf (at least one token survives)."""
    vocab = logits.shape[1]
    if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1 for p in params):
        top_k = _on(logits.device, [p.top_k if p.top_k > 0 else vocab for p in params])
        # (top_p=1 drops nothing: a float32 running sum overshoots 1 by rounding, so a row without
        # top-p compared with 1 would lose its least likely tokens whenever a neighbour filters)
        top_p = _on(logits.device, [p.top_p if p.top_p < 1 else float("inf") for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = _on(logits.device, [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def _on(device, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: `torch.tensor(values,
    device=cuda)` copies from pageable memory, which synchronizes the stream, so the host would
    stop until the step's forward pass is done; this goes through pinned memory, non-blocking."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _uniform_draws(requests: list[CachedRequestState], device) -> torch.Tensor:
    """One uniform number in [0, 1) per row; a seeded row's is its seed's number for the output
    position it samples (the request's next)."""
    draws = torch.rand(len(requests), dtype=torch.float64)
    if all(request.seeded_draws is None for request in requests):
        return to_device(draws, device)
    values = draws.tolist()  # (one tensor made from the list: a tensor element set per row cost ~3 us each)
    for row, request in enumerate(requests):
        if request.seeded_draws is not None:
            values[row] = request.seeded_draws.at(request.num_tokens - request.num_prompt_tokens)
    return to_device(torch.tensor(values, dtype=torch.float64), device)


def _inverse_transform(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The token where each row's cumulative probability first exceeds its draw (scaled to the
    row's total); a token of probability zero is never returned."""
    cumulative = probs.cumsum(dim=-1)
    targets = (draws * cumulative[:, -1].double()).to(cumulative.dtype)
    tokens = torch.searchsorted(cumulative, targets[:, None], right=True).squeeze(1).clamp(max=probs.shape[1] - 1)
    # Rounding can land a target on the total: take the row's last possible token instead. (Found on the
    # probabilities, not on their running sum, whose adding order a device's scan may change: one flip of
    # a byte mask, a quarter of the bytes of a flipped copy of the probabilities.)
    impossible = probs.gather(1, tokens[:, None]).squeeze(1) <= 0
    last_possible = probs.shape[1] - 1 - (probs > 0).flip(-1).view(torch.uint8).argmax(dim=-1)
    return torch.where(impossible, last_possible, tokens)
