"""The engine's view of one sequence being generated (or prefilled)."""
from __future__ import annotations

import enum
import hashlib
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from treeserve.engine.seeded_draws import SeededDraws
from treeserve.sampling_params import SamplingParams


# Priority of work submitted on a caller's behalf in bulk (search samples, verifier scoring): an
# interactive request (priority 0) is admitted ahead of it, so chats keep a short time to first token.
BACKGROUND_PRIORITY = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


_FINISHED = RequestStatus.FINISHED  # (a module constant: an Enum member's lookup costs more)


def hash_block(parent: bytes | None, tokens: list[int], extra: bytes) -> bytes:
    """Chained block hash: hash(parent hash, this block's tokens, extra keys such as a cache salt)."""
    return hashlib.sha256((parent or b"root") + array("q", tokens).tobytes() + extra).digest()


def hash_blocks(parent: bytes | None, tokens: list[int], count: int, block_size: int, extra: bytes) -> list[bytes]:
    """`count` chained hashes of consecutive `block_size`-token blocks of `tokens`, each
    `hash_block` of the one before (a block past the end of `tokens` holds what is left of them):
    the tokens become bytes once, not per block, which counts with many small blocks."""
    data, width = array("q", tokens).tobytes(), 8 * block_size
    sha256, hashes = hashlib.sha256, []
    parent = parent or b"root"
    for start in range(0, count * width, width):
        parent = sha256(parent + data[start:start + width] + extra).digest()
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    cache_salt: str | None = None
    cache_namespace: str = ""           # the model, when several share one block pool
    prefill_only: bool = False          # compute the prompt's KV (and optional logits), sample nothing
    logits_positions: list[int] | None = None  # prompt positions whose logits a prefill-only request returns
    readout_token_ids: list[int] | None = None  # only these vocabulary columns of those logits (None: all)
    keep_kv: bool = False                       # on finishing, keep the KV blocks for later forks
    priority: int = 0                   # lower is admitted first (interactive 0, search work 1); FCFS within
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_passed_over: int = 0            # times later waiting requests were admitted first (cache-aware order)
    num_in_flight: int = 0              # tokens sampled by a step still running (async scheduling), not known yet
    speculative_config: Any = None      # what it speculates with (a SpeculativeConfig; None: it does not)
    draft_group: str | None = None      # speculation's `suffix` drafts from every sequence of this group
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens its next step verifies
    draft_pace: Any = None              # how far it drafts next (engine/spec_decode/pace.py)
    seeded_draws: SeededDraws | None = None  # a seeded request's uniform numbers by output position
    num_draft_tokens: int = 0           # draft tokens its steps verified, and how many were kept
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    logprobs: list[dict[int, Any]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # With prompt_logprobs: the whole prompt (a shared prefill computes its group's, whose last
    # token it does not hold), and by position the entries computed so far (position 0 has none).
    prompt_logprob_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    detokenizer: Any = None
    matcher: Any = None  # with structured outputs: the grammar's state (engine/structured_outputs.py)
    # sampled tokens whose text is not made yet: (token id, its logprobs, ended the sequence as a stop token)
    pending_text: list[tuple[int, dict | None, bool]] = field(default_factory=list)
    # delta outputs (RequestOutputKind.DELTA): how much of its tokens, text and logprobs earlier
    # outputs held, and whether one reported its finish
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0
    sent_finish: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self._extra_key = f"{self.cache_namespace}\x00{self.cache_salt or ''}".encode()
        self.seeded_draws = SeededDraws.of(self.sampling_params.seed)  # (the sampler takes a Request too)
        allowed = self.sampling_params.allowed_token_ids  # (a draft outside it is cut: spec_decode/draft_rows.py)
        self.allowed_token_set = frozenset(allowed) if allowed else None
        if self.sampling_params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens, and the one a running step is sampling (async scheduling)."""
        return len(self.all_token_ids) + self.num_in_flight

    @property
    def ends_with_in_flight(self) -> bool:
        """The token in flight is its last (max_tokens): nothing more to schedule for it."""
        return self.num_in_flight > 0 and self.num_output_tokens + self.num_in_flight >= self.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def recent_output(self, count: int) -> list[int]:
        """The last `count` output tokens (fewer if it has fewer)."""
        return self.output_token_ids[max(len(self.output_token_ids) - count, 0):]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def max_cached_blocks(self, block_size: int) -> int:
        """Full blocks a prefix-cache hit may cover: the last token, every prompt position whose
        logits a prefill-only request returns, and with prompt logprobs the whole prompt, must be
        computed by this request itself."""
        if self.prompt_logprob_ids is not None:
            return 0  # every prompt position's logits are wanted (engine/prompt_logprobs.py)
        limit = len(self.all_token_ids) - 1
        if self.logits_positions:
            limit = min(limit, self.logits_positions[0])
        return limit // block_size

    def ensure_block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Extends the chained hashes to cover the first `num_blocks` full blocks."""
        hashes = self.block_hashes
        done = len(hashes)
        if done < num_blocks:
            tokens = self.all_token_ids[done * block_size:num_blocks * block_size]
            hashes.extend(hash_blocks(hashes[-1] if done else None, tokens, num_blocks - done, block_size,
                                      self._extra_key))
        return hashes


@dataclass(eq=False)
class RequestGroup:
    """One user request: `n` sequences that share the prompt, and the prefill that they fork from."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    shared_prefill: Request | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None  # filled by the request computing the prompt
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    final_only: bool = False  # one RequestOutput, when it finishes (vLLM's RequestOutputKind.FINAL_ONLY)
    delta: bool = False  # each RequestOutput holds only what is new (RequestOutputKind.DELTA)
    prompt_counted: bool = False  # its prompt is in the engine's num_prompt_tokens (its prefill is done)

    @property
    def finished(self) -> bool:
        for child in self.children:  # (a loop, not all(): this runs for every request at every step)
            if child.status is not _FINISHED:
                return False
        return True

    def members(self) -> list[Request]:
        """Its samples, and the shared prefill while it computes their prompt."""
        return self.children + ([self.shared_prefill] if self.shared_prefill is not None else [])
