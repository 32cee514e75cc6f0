"""The engine's side of speculation: before each schedule, drafts for the running requests that
may take them; after each step, what was accepted (vLLM's spec-decode counters)."""
from __future__ import annotations

from treeserve.engine.request import Request
from treeserve.engine.spec_decode.pace import DraftPace
from treeserve.engine.spec_decode.proposer import DraftProposer
from treeserve.engine.spec_decode.step_costs import StepCosts
from treeserve.speculative_config import SpeculativeConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config, self.max_model_len = config, max_model_len
        self.proposer = DraftProposer(config)
        self.costs = StepCosts()
        self.num_drafts = 0           # verified drafts (one per request and step that had any)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Request]) -> None:
        """Sets each running request's `spec_token_ids` (none while the batch is at
        `disable_by_batch_size`, or for a request that may not take them)."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) >= limit
        self.proposer.retain(running)
        threshold = self.costs.keep_threshold(len(running))
        for request in running:
            k = 0 if off else self._room(request, threshold)
            request.spec_token_ids = self.proposer.propose(request, k, threshold) if k > 0 else []

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step's rows and how long it took (the cost model behind the drafts' length)."""
        self.costs.observe(rows, seconds)

    def _room(self, request: Request, threshold: float) -> int:
        """How many drafts the request may verify in its next step: 0 unless it decodes (its last
        token alone uncomputed, none in flight) under plain sampling rules; no more than its pace
        (pace.py), max_tokens and the model's length allow (the step emits drafts + 1)."""
        params = request.sampling_params
        if (request.prefill_only or request.num_in_flight or request.matcher is not None
                or request.num_computed_tokens != request.num_tokens - 1
                or request.num_output_tokens < params.min_tokens
                or params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1):
            return 0
        left = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        k = self.config.num_speculative_tokens
        if request.draft_pace is None:
            request.draft_pace = DraftPace()
        return max(min(request.draft_pace.allowed(threshold, k), left), 0)

    def verified(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """A step verified the request's drafts: its pace and the counters move."""
        request.draft_pace.update(num_draft_tokens, num_accepted)
        self.record(num_draft_tokens, num_accepted)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
