"""Turns a step's logits into next tokens: grammar masks (structured outputs), logit bias,
penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

All filtering is batched over the rows. A row samples by inverse transform: one uniform draw
against its cumulative probabilities. Requests with their own seed draw that number from their
own generator, so a seeded request samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.engine import structured_outputs
from treeserve.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None]  # token -> (logprob, rank), per row


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        params = [r.sampling_params for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        structured_outputs.apply(logits, [r.matcher for r in requests])
        self._add_logit_bias(logits, params)
        logits = self._mask_stops_below_min_tokens(logits, requests)
        logits = self._apply_penalties(logits, requests)
        token_ids = self._pick(logits, requests)
        logprobs = self._gather_logprobs(raw_logprobs, token_ids, requests)
        return SamplerOutput(token_ids.tolist(), logprobs)

    @staticmethod
    def _add_logit_bias(logits, params) -> None:
        for row, p in enumerate(params):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[row, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)

    @staticmethod
    def _mask_stops_below_min_tokens(logits, requests):
        for row, request in enumerate(requests):
            p = request.sampling_params
            if request.num_output_tokens < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
                if stops:
                    logits[row, stops] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits, requests):
        params = [r.sampling_params for r in requests]
        if all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params):
            return logits
        device, vocab = logits.device, logits.shape[1]
        counts = _token_counts([r.output_token_ids for r in requests], vocab, device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0)
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        if (repetition != 1).any():
            seen = (counts + _token_counts([r.prompt_token_ids for r in requests], vocab, device)) > 0
            penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits = torch.where(seen, penalised, logits)
        return logits

    def _pick(self, logits, requests):
        params = [r.sampling_params for r in requests]
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        token_ids = logits.argmax(dim=-1)
        if greedy.all():
            return token_ids
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        probs = torch.softmax(_filter(logits / temperature[:, None], params), dim=-1)
        sampled = _inverse_transform(probs, _uniform_draws(requests, probs.device))
        return torch.where(greedy, token_ids, sampled)

    @staticmethod
    def _gather_logprobs(raw_logprobs, token_ids, requests):
        out: list[dict[int, tuple[float, int]] | None] = []
        for row, request in enumerate(requests):
            k = request.sampling_params.logprobs
            if k is None:
                out.append(None)
                continue
            row_lp = raw_logprobs[row]
            chosen = int(token_ids[row])
            chosen_lp = row_lp[chosen]
            entry = {chosen: (float(chosen_lp), int((row_lp > chosen_lp).sum()) + 1)}
            if k > 0:
                top_lp, top_ids = row_lp.topk(k)
                for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
                    entry.setdefault(tid, (lp, rank))
            out.append(entry)
        return out


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Applies top-k, top-p and min-p by masking logits to -inf (at least one token survives)."""
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if (min_p > 0).any():
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def _uniform_draws(requests: list[Request], device) -> torch.Tensor:
    """One uniform number in [0, 1) per row; seeded rows draw theirs from their own generator."""
    draws = torch.rand(len(requests), dtype=torch.float64)
    for row, request in enumerate(requests):
        if request.generator is not None:
            draws[row] = float(torch.rand((), dtype=torch.float64, generator=request.generator))
    return draws.to(device)


def _inverse_transform(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The token where each row's cumulative probability first exceeds its draw (scaled to the
    row's total); a token of probability zero is never returned."""
    cumulative = probs.cumsum(dim=-1)
    targets = (draws * cumulative[:, -1].double()).to(cumulative.dtype)
    tokens = torch.searchsorted(cumulative, targets[:, None], right=True).squeeze(1).clamp(max=probs.shape[1] - 1)
    # Rounding can land a target on the total: take the row's last possible token instead.
    impossible = probs.gather(1, tokens[:, None]).squeeze(1) <= 0
    if impossible.any():
        last_possible = probs.shape[1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        tokens = torch.where(impossible, last_possible, tokens)
    return tokens
