"""Continuous batching under a token budget (vLLM v1's rule).

There are no prefill or decode phases: each step, every scheduled request closes as much of the
gap between its known tokens and its computed tokens as the budget allows. Running requests go
first (FCFS); waiting ones are admitted by priority (an interactive request goes ahead of queued
search work), interactive ones in arrival order and background ones longest cached prefix first,
while budget, sequence slots and KV blocks last. When blocks run out, the most recently admitted
running request is preempted and later recomputed.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import BACKGROUND_PRIORITY, Request, RequestStatus

# Waiting requests considered for reordering each step (SGLang also stops ranking past a long queue).
LPM_WINDOW = 256
# Times a background request may be passed over by later ones with longer cached prefixes.
MAX_PASSED_OVER = 32


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int       # draft tokens included
    num_draft_tokens: int = 0  # speculation: the request's `spec_token_ids` this step verifies

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so its logits are needed."""
        return self.request.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    yielded: bool = False  # another model waits for the pool's blocks: no request that holds none was admitted

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 reclaim: Callable[[], bool] | None = None, shared_num_batched_tokens: int | None = None):
        """`max_num_batched_tokens`: the most tokens a step holds, taken while one request is all the
        work; `shared_num_batched_tokens` (default the same): the budget whenever there are more
        (engine/token_budget.py)."""
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shared_num_batched_tokens = min(shared_num_batched_tokens or max_num_batched_tokens,
                                             max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Frees one retained (finished but kept) sequence's blocks; tried before any preemption.
        self.reclaim: Callable[[], bool] = reclaim or (lambda: False)

    @property
    def owner(self) -> str:
        """The model whose requests this scheduler schedules (its name in a shared KV pool)."""
        return self.kv.owner

    def add(self, request: Request) -> None:
        """Queues a request behind every waiting one of its priority or a more urgent one."""
        if not self.waiting or self.waiting[-1].priority <= request.priority:
            self.waiting.append(request)
            return
        index = next(i for i, r in enumerate(self.waiting) if r.priority > request.priority)
        self.waiting.insert(index, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self._step_budget())
        out.yielded = bool(self.waiting) and self.kv.pool.waits_for_blocks(other_than=self.kv.owner)
        if not out.preempted:
            self._schedule_waiting(out, budget, holding_only=out.yielded)
        if not self.waiting:
            self._forget_wanted()
        out.block_copies = self.kv.take_pending_copies()
        return out

    def _step_budget(self) -> int:
        lone = len(self.running) + len(self.waiting) == 1
        return self.max_num_batched_tokens if lone else self.shared_num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or request.ends_with_in_flight:  # (async scheduling) it waits for its last step
                index += 1
                continue
            drafts = _drafts_within(request, num_new, budget) if request.spec_token_ids else 0
            num_new += drafts
            while not self.kv.allocate_slots(request, num_new):
                if drafts:  # short of blocks: its drafts go before anything is reclaimed or preempted
                    num_new, drafts, request.spec_token_ids = num_new - drafts, 0, []
                    continue
                if self.reclaim():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, holding_only: bool = False) -> None:
        """Admits waiting requests; with `holding_only` (another model waits for the pool's blocks),
        only those that hold blocks already (forks not yet run: they end and free them)."""
        in_flight = self._blocks_in_flight()
        order = self._admission_order()
        admitted: list[int] = []
        for position, request in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if holding_only and not self.kv.block_tables.get(request.request_id):
                continue
            num_new = self._admit(request, budget, in_flight)
            if num_new is None:
                continue  # it waits: for a prefix a running request computes, or to spare queued hits
            if num_new is False:
                break
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            admitted.append(position)
        self._count_passed_over(order, admitted)

    def _admit(self, request: Request, budget: int, in_flight: set[bytes]):
        """Moves a waiting request to running: its number of tokens scheduled, None when it should
        wait (for a prefix in flight, or to spare what queued work will hit), False when KV blocks
        are short."""
        while True:
            prefix = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else None
            cached = prefix.num_tokens if prefix else 0
            if prefix is not None and self._next_block_in(request, cached, in_flight):
                return None
            num_new = min(request.num_tokens - request.num_computed_tokens - cached, budget)
            if not self.kv.can_allocate(request, num_new, prefix):
                if self.reclaim() or (not self.running and self._unpin_waiting(request)):
                    continue
                return False
            if self._spares_wanted(request, num_new, prefix):
                self.kv.allocate_slots(request, num_new, prefix)
                break
            if not self.reclaim():
                return None  # it waits a step; requests behind it that fit may go
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens += cached  # a fork arrives with its parent's tokens counted
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        in_flight.update(self._uncomputed_prompt_blocks(request))
        return num_new

    def _spares_wanted(self, request: Request, num_new: int, prefix) -> bool:
        """Background work is not admitted by evicting prefixes that other waiting requests will hit
        while something runs: it waits a step for the running requests to free their blocks (a
        verifier request lives one step) instead of destroying queued work's cache hits."""
        if request.priority < BACKGROUND_PRIORITY or not self.running or request.num_passed_over >= MAX_PASSED_OVER:
            return True
        return self.kv.fits_without_wanted(request, num_new, prefix)

    def _admission_order(self) -> list[tuple[int, Request]]:
        """Waiting requests in the order to try them, each with its place in the queue; marks the
        cached blocks they will hit as wanted (evicted last).

        Interactive requests keep arrival order. Background work (search and verifier requests) of
        one priority goes longest cached prefix first (SGLang's LPM): a search asks for many
        requests at once, and serving the ones whose prefixes are still cached before the others
        evict them turns a cyclic sweep (every lookup a miss) into hits. A request passed over
        MAX_PASSED_OVER times goes first, so none waits forever."""
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        if not self.kv.pool.enable_caching:
            return list(enumerate(window))
        cached, wanted = [], []
        for request in window:
            if request.num_computed_tokens:  # a fork: it holds its parent's blocks already
                cached.append(request.num_computed_tokens)
                continue
            prefix = self.kv.find_cached_prefix(request, with_thrash=False)
            cached.append(prefix.num_tokens)
            wanted.extend(prefix.blocks)
        self.kv.pool.set_wanted(self.kv.owner, wanted)
        return sorted(enumerate(window), key=lambda item: self._rank(*item, cached[item[0]]))

    @staticmethod
    def _rank(position: int, request: Request, cached: int) -> tuple:
        if request.priority < BACKGROUND_PRIORITY or request.num_passed_over >= MAX_PASSED_OVER:
            return (request.priority, 0, 0, position)
        return (request.priority, 1, -cached, position)

    @staticmethod
    def _count_passed_over(order: list[tuple[int, Request]], admitted: list[int]) -> None:
        """Each waiting request that a later one (in arrival order) went ahead of counts one more."""
        if not admitted:
            return
        last, taken = max(admitted), set(admitted)
        for position, request in order:
            if position < last and position not in taken:
                request.num_passed_over += 1

    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests have yet to compute.

        Requests sharing a prefix that is not cached yet would otherwise all compute it in the
        same step; the later ones wait until it is cached (SGLang's in-batch prefix sharing).
        """
        if not self.kv.pool.enable_caching:
            return set()
        # (a decode, past its prompt, has none: most running requests, skipped without a call)
        return {h for r in self.running if r.num_computed_tokens < len(r.prompt_token_ids)
                for h in self._uncomputed_prompt_blocks(r)}

    def _uncomputed_prompt_blocks(self, request: Request) -> list[bytes]:
        size = self.kv.block_size
        first, end = request.num_computed_tokens // size, request.num_prompt_tokens // size
        if first >= end or not self.kv.pool.enable_caching:
            return []
        return request.ensure_block_hashes(end, size)[first:end]

    def _next_block_in(self, request: Request, cached: int, in_flight: set[bytes]) -> bool:
        size = self.kv.block_size
        index = cached // size
        if not in_flight or index >= request.max_cached_blocks(size):
            return False
        return request.ensure_block_hashes(index + 1, size)[index] in in_flight

    def _unpin_waiting(self, admitting: Request) -> bool:
        """Frees the blocks of a waiting request that holds some (a fork not yet run), newest first.

        Only used when nothing runs: forks waiting to start could otherwise pin every block.
        """
        for request in reversed(self.waiting):
            if request is not admitting and self.kv.block_tables.get(request.request_id):
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.num_cached_tokens = 0  # it will look the prefix up afresh
                request.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

    def _forget_wanted(self) -> None:
        if self.kv.pool.wanted_by_owner.get(self.kv.owner):
            self.kv.pool.set_wanted(self.kv.owner, [])

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str, stop_reason=None, keep_blocks: bool = False) -> None:
        """Ends a request (finished or aborted) and releases its blocks at once (unless kept for forks)."""
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            if not self.waiting:
                self._forget_wanted()
        if not keep_blocks:
            self.kv.free(request)


def _drafts_within(request: Request, num_new: int, budget: int) -> int:
    """How many of a decoding request's draft tokens its step verifies: what the budget leaves
    (the drafts not taken are dropped)."""
    if not request.spec_token_ids:
        return 0
    if num_new != 1:  # (a proposer drafts for decodes only)
        request.spec_token_ids = []
        return 0
    del request.spec_token_ids[max(budget - 1, 0):]
    return len(request.spec_token_ids)
