"""A scheduler step as plain data: what a model runner (in this process or a worker's) needs, and
what it returns, keyed by request id.

A request reaches the runner once as `NewRequestData` (its tokens, block table and sampling
settings); afterwards only what changed: the tokens sampled since (`CachedRequestData`), the block
table's new tail, the number of computed tokens. Finished, aborted and preempted requests are
named in `finished_req_ids` so the runner drops its state (a preempted one comes back as new).
Everything here pickles, so a step can go to another process as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeserve.sampling_params import SamplingParams

# A token sampled by the step still running on the device (async scheduling): the runner takes its
# value from that step's sampled ids on the device, and fills it in when the step's results arrive.
IN_FLIGHT_TOKEN = -1


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]              # every known token: the prompt, then outputs so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prefill_only: bool = False
    logits_positions: list[int] | None = None
    readout_token_ids: list[int] | None = None
    prompt_logprob_ids: list[int] | None = None  # the prompt whose logprobs this request computes


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]          # tokens appended since the runner last saw the request
    block_ids_from: int               # the block table keeps its first entries up to here ...
    new_block_ids: list[int]          # ... then these (appended blocks, or a copied-on-write tail)
    num_computed_tokens: int


@dataclass
class StepData:
    scheduled: list[tuple[str, int]] = field(default_factory=list)  # (request id, tokens this step), in order
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # structured outputs: the rows of `grammar_bitmask` (llguidance's packed int32 bitmask) by request id
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # speculation: the draft tokens each request's step verifies (its scheduled count includes them)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # ... and for a constrained one, its grammar's bitmask at each of its k + 1 rows
    spec_grammar_bitmasks: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, tuple[int, dict | None]] = field(default_factory=dict)  # request id -> (token id, logprobs)
    readouts: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)  # (request id, position, logits)
    prompt_logprobs: list[tuple[str, int, dict]] = field(default_factory=list)  # (request id, position, entry)
    # speculation: per request that verified drafts, the tokens it emits (accepted drafts, then the
    # one the model sampled after them), each with its logprobs
    accepted: dict[str, list[tuple[int, dict | None]]] = field(default_factory=dict)
    # EAGLE: the step's rows of what the head reads (the runner's `capture`), and each row's
    # (request id, position); None unless captured
    hidden_rows: tuple[torch.Tensor, list[tuple[str, int]]] | None = None
