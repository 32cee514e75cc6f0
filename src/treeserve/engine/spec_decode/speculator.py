"""The engine's side of speculation: before each schedule, drafts for the running requests that
may take them; after each step, what was accepted (vLLM's spec-decode counters).

A request speculates with the engine's `speculative_config` unless it brings its own (a search's
`speculative_config`) or asks for none; the engine keeps one proposer per configuration. Until a
request speculates, nothing here runs."""
from __future__ import annotations

from typing import Callable

from treeserve.engine import structured_outputs
from treeserve.engine.request import Request
from treeserve.engine.spec_decode.draft_rows import permitted_drafts
from treeserve.engine.spec_decode.pace import INITIAL_RATE, DraftPace, kept_rate
from treeserve.engine.spec_decode.proposer import DraftProposer, PerRequestProposer
from treeserve.engine.spec_decode.step_costs import StepCosts
from treeserve.errors import ParamError
from treeserve.speculative_config import MODEL_METHODS, SpeculativeConfig

ENGINE_DEFAULT = "engine"  # `add_request(speculative_config=...)`'s default: the engine's configuration
RATE_WEIGHT = 0.02  # of one verification in the engine-wide rate


class Speculator:
    """`load_draft(config)`: the proposer of a configuration that loads a model (`draft_model`),
    made at once for the engine's own configuration (a bad draft checkpoint fails the start)."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int,
                 load_draft: Callable[[SpeculativeConfig], PerRequestProposer] | None = None):
        self.config, self.max_model_len = config, max_model_len  # `config`: the engine's (None: off)
        self.active = config is not None  # whether any request may speculate
        self.load_draft = load_draft
        self.proposers: dict[SpeculativeConfig, PerRequestProposer] = {}
        self.costs = StepCosts()
        self.rate = INITIAL_RATE  # the chance a draft token is kept, over recent drafts of every request
        self.num_drafts = 0           # verified drafts (one per request and step that had any)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.capturing = True  # whether some running request may draft with the engine's proposer
        if config is not None:
            self._proposer(config)

    def config_for(self, requested) -> SpeculativeConfig | None:
        """What a new request speculates with: the engine's (ENGINE_DEFAULT), its own (a dict or
        SpeculativeConfig), or nothing (None)."""
        if isinstance(requested, str) and requested == ENGINE_DEFAULT:
            return self.config
        config = self.check(requested)
        self.active |= config is not None
        return config

    def check(self, requested) -> SpeculativeConfig | None:
        """A request's own configuration, validated: one that loads a model must be the engine's
        (a request never makes the server load a checkpoint)."""
        config = SpeculativeConfig.of(requested)
        if config is not None and config.method in MODEL_METHODS and config != self.config:
            raise ParamError("speculative_config", f"a request may not load a model ({config.method!r}): only the "
                             "engine's own configuration, set when it starts (--speculative-config), drafts with one")
        return config

    def propose(self, running: list[Request]) -> None:
        """Sets each running request's `spec_token_ids` (none while its configuration's
        `disable_by_batch_size` requests run, or for a request that may not take them)."""
        if not self.active:
            return
        self.retain(running)
        measured = self.costs.keep_threshold(len(running))
        token_seconds = self.costs.token_seconds(len(running))
        wanted: dict[SpeculativeConfig, list[tuple[Request, int, float]]] = {}
        capturing, anyone = False, False
        for request in running:
            config = request.speculative_config
            if config is None:
                continue
            request.spec_token_ids = []
            # (a seeded request's samples follow from its seed and positions alone, drafts or not: rejection.py)
            threshold = measured + self._proposer(config).pass_costs.share_of(token_seconds)
            limit = config.disable_by_batch_size
            mine = config == self.config
            anyone |= mine
            if (limit is not None and len(running) >= limit) or threshold >= 1:
                continue  # (a threshold of 1: not even a sure draft token pays for its row and passes)
            capturing |= mine
            k = self._room(request, config, threshold)
            if k > 0:
                wanted.setdefault(config, []).append((request, k, threshold))
        self.capturing = capturing or not anyone  # (requests about to start: their prompts' features)
        for config, items in wanted.items():
            for (request, _, _), drafts in zip(items, self._proposer(config).propose_all(items)):
                if drafts and request.matcher is not None:  # (structured outputs) what the grammar would accept
                    drafts = structured_outputs.valid_draft(request.matcher, drafts)
                drafts = permitted_drafts(request, drafts)  # (its processing: allowed tokens, bad words, min_tokens)
                request.spec_token_ids = drafts

    @property
    def step_capture(self) -> str | None:
        """What the runner keeps of this step's rows: the engine proposer's features while some
        request may draft with it; nothing while none may (their positions read zeros later)."""
        return self.capture if self.capturing else None

    @property
    def capture(self) -> str | None:
        """What the target's runner must keep of each step's rows for the engine's proposer (an
        EAGLE head's features), or None."""
        proposer = self.proposers.get(self.config) if self.config is not None else None
        return getattr(proposer, "capture", None)

    def observe_hidden(self, hidden_rows, requests: dict[str, Request]) -> None:
        """A step's captured rows (the runner's `capture`) to the proposer that reads them."""
        if hidden_rows is not None:
            self.proposers[self.config].observe(*hidden_rows, requests)

    def retain(self, running: list[Request]) -> None:
        """What the proposers hold for requests no longer running goes (draft KV: at once)."""
        for proposer in self.proposers.values():
            proposer.retain(running)

    def release_kv(self) -> bool:
        """Every proposer's draft KV back to the pool (the scheduler runs short); whether any was held."""
        return any([proposer.release() for proposer in self.proposers.values()])

    def close(self) -> None:
        """Lets go of every proposer (a draft model's weights freed, an EAGLE head's dropped: it shares
        the target's embedding); the counters stay."""
        for proposer in self.proposers.values():
            close = getattr(proposer, "close", None)
            if close is not None:
                close()
        self.proposers.clear()
        self.load_draft = None

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step's rows and how long it took (the cost model behind the drafts' length)."""
        if self.active:
            self.costs.observe(rows, seconds)

    def _proposer(self, config: SpeculativeConfig) -> PerRequestProposer:
        proposer = self.proposers.get(config)
        if proposer is None:
            if config.method in MODEL_METHODS:
                if self.load_draft is None:
                    raise ParamError("speculative_config", f"method {config.method!r} needs an engine to load "
                                     "its model into")
                proposer = self.load_draft(config)
            else:
                proposer = DraftProposer(config)
            self.proposers[config] = proposer
        return proposer

    def _room(self, request: Request, config: SpeculativeConfig, threshold: float) -> int:
        """How many drafts the request may verify in its next step: 0 unless it decodes (its last
        token alone uncomputed, none in flight); no more than its pace (pace.py), max_tokens and the
        model's length allow (the step emits drafts + 1). (Penalties, allowed_token_ids, bad_words
        and min_tokens draft too: each verified row is processed as the sampler's decode row would
        be after the drafts before it, rejection.py; a draft that processing forbids is cut, with the
        drafts after it, before they are verified: draft_rows.permitted_drafts.)"""
        if (request.prefill_only or request.num_in_flight
                or request.num_computed_tokens != request.num_tokens - 1):
            return 0
        left = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        if request.draft_pace is None:
            request.draft_pace = DraftPace.starting(self.rate, threshold)
        return max(min(request.draft_pace.allowed(threshold, config.num_speculative_tokens), left), 0)

    def verified(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """A step verified the request's drafts: its pace and the counters move."""
        request.draft_pace.update(num_draft_tokens, num_accepted)
        self.proposers[request.speculative_config].verified(request, num_accepted)
        request.num_draft_tokens += num_draft_tokens
        request.num_accepted_tokens += num_accepted
        self.rate += RATE_WEIGHT * (kept_rate(num_draft_tokens, num_accepted) - self.rate)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
