"""What the offline API returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    n: int = 1                        # the request's parameters (set on its finished output)
    max_tokens: int | None = None     # its samples' token limit (None: a prefill-only request)
    longest_sample: int = 0           # its longest sample's generated tokens (set on its finished output)


@dataclass(frozen=True)
class AbortedRequest:
    """What an aborted request had done when it was cut: for metrics, which count a request's
    tokens and finishes as they happen, not only when it ends."""
    request_id: str
    samples: tuple[tuple[int, str | None], ...]  # each sample's generated tokens and finish (None: cut)
    delta: bool                                # RequestOutputKind.DELTA: each sample's finish was reported as it came


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), as vLLM
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # speculative decoding: draft tokens verified for it (all its samples) and how many were kept
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # RequestOutputKind.DELTA: each completion holds only what is new since the request's last output
    # (its text, token ids and logprobs; cumulative_logprob stays the running sum)
    delta: bool = False
