"""Which sequences' n-grams a running request's draft comes from (`ngram`: its own prompt and
output; `suffix`: every sequence of its draft group, and the outputs of every request the engine
served lately, as Arctic's suffix decoding keeps a global tree of earlier responses), and the
drafts of one step."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict

from treeserve.engine.request import Request
from treeserve.engine.spec_decode.continuation_counts import MIN_PATH_PROBABILITY, ContinuationCounts, draft
from treeserve.engine.spec_decode.ngram_index import NgramIndex
from treeserve.engine.spec_decode.step_costs import PassCosts
from treeserve.speculative_config import SpeculativeConfig

MAX_GROUPS = 256  # draft groups whose index is kept (least recently used dropped first)
MAX_GLOBAL_NGRAMS = 1 << 20  # `suffix`: the earlier outputs' index starts afresh beyond this many n-grams


class PerRequestProposer(ABC):
    """A proposer that drafts for one request at a time (the Speculator asks for a step's drafts at
    once: `propose_all`) and holds no KV (`release` frees nothing). `pass_costs`: what its own work
    costs per draft token (a model's passes; the lookups' host time), unmeasured here."""

    pass_costs = PassCosts()

    def propose_all(self, wanted: list[tuple[Request, int, float]]) -> list[list[int]]:
        """Each (request, k, threshold)'s draft, in order."""
        return [self.propose(request, k, threshold) for request, k, threshold in wanted]

    @abstractmethod
    def propose(self, request: Request, k: int, threshold: float) -> list[int]:
        """Up to `k` draft tokens for the request's next step."""

    def retain(self, running: list[Request]) -> None:
        pass

    def release(self) -> bool:
        return False

    def verified(self, request: Request, num_accepted: int) -> None:
        """A step verified the request's drafts (before its computed tokens count them)."""


class DraftProposer(PerRequestProposer):
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.pass_costs = PassCosts()  # the lookups' host time per draft token (priced like a model's passes)
        self._indexes: OrderedDict[str, NgramIndex | ContinuationCounts] = OrderedDict()
        self._outputs = ContinuationCounts(config.prompt_lookup_min, config.prompt_lookup_max)  # `suffix`: every output

    def propose_all(self, wanted: list[tuple[Request, int, float]]) -> list[list[int]]:
        """The step's drafts, their host time measured: where a row is cheap (a small model's big
        batch) indexing and looking up cost more than a kept token saves, and drafting stops. A
        request whose index is new is not measured: indexing its prompt is paid once, not per draft
        (counted, one long prompt's probe would price drafting out for good)."""
        drafts, seconds, tokens = [], 0.0, 0
        for request, k, threshold in wanted:
            indexed = self._key(request) in self._indexes
            started = time.perf_counter()
            drafts.append(self.propose(request, k, threshold))
            if indexed:
                seconds += time.perf_counter() - started
                tokens += len(drafts[-1])
        self.pass_costs.observe(seconds, tokens)
        return drafts

    def propose(self, request: Request, k: int, threshold: float) -> list[int]:
        """Up to `k` draft tokens for the request's next step (its tokens indexed first); `suffix`
        drafts stop where the path's frequency falls under `threshold` (or 0.1)."""
        index = self._index_of(request)
        tokens = request.all_token_ids
        if self.config.method == "ngram":
            index.extend(tokens)
            return index.propose(tokens, k)
        # the group's root prompt is indexed once; every member's output as it grows, in both indexes
        index.extend(tokens, start=request.num_prompt_tokens)
        if len(self._outputs) > MAX_GLOBAL_NGRAMS:
            self._outputs.clear()
        self._outputs.extend(tokens, start=request.num_prompt_tokens)
        return draft([index, self._outputs], tokens, k, max(threshold, MIN_PATH_PROBABILITY))

    def retain(self, running: list[Request]) -> None:
        """`ngram`: the indexes of requests no longer running go (a preempted one is indexed again
        when it runs); `suffix` groups stay for their siblings, the least recently used beyond
        MAX_GROUPS dropped."""
        if self.config.method == "ngram" and len(self._indexes) > len(running):
            live = {r.request_id for r in running}
            for key in [k for k in self._indexes if k not in live]:
                del self._indexes[key]

    def _key(self, request: Request) -> str:
        return request.request_id if self.config.method == "ngram" else _group_of(request)

    def _index_of(self, request: Request) -> NgramIndex | ContinuationCounts:
        key = self._key(request)
        index = self._indexes.get(key)
        if index is None:
            kind = NgramIndex if self.config.method == "ngram" else ContinuationCounts
            index = self._indexes[key] = kind(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            if self.config.method == "suffix":
                index.extend(list(request.prompt_token_ids))  # the group's root prompt (a copy: it never grows)
            while len(self._indexes) > MAX_GROUPS:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(key)
        return index


def _group_of(request: Request) -> str:
    return request.draft_group or request.request_id
