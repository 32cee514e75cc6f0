"""The step pipeline: schedule, build the step's inputs, launch it on the model, apply its results.

With async scheduling, a sampling step whose samples need nothing from the host before the next one
(no grammar, no penalties) and that holds no prefill-only request is left running: the next call
schedules and launches the step after it (its inputs take the sampled ids on the device), then
applies this one's results while the device runs that one. A request whose step in flight ends it
(a stop token, a stop string) may have computed one token more, which is dropped.

The pipeline is the one place where a step's computed tokens are counted into its requests, their
full blocks cached and the blocks behind a sliding window freed (`_computed`)."""
from __future__ import annotations

import time

from treeserve.engine.deferred_outputs import DeferredOutputs
from treeserve.engine.kept_kv import KeptSequences
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.model_runner import ModelRunner
from treeserve.engine.request import Request, RequestGroup
from treeserve.engine.request_groups import RequestGroups
from treeserve.engine.sampler import penalized
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.spec_decode.speculator import Speculator
from treeserve.engine.step_builder import StepBuilder
from treeserve.engine.workers_guard import WorkersGuard
from treeserve.outputs import RequestOutput


class StepPipeline:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, steps: StepBuilder, runner: ModelRunner,
                 groups: RequestGroups, outputs: DeferredOutputs, retained: KeptSequences, guard: WorkersGuard,
                 async_scheduling: bool, send_step=None, speculator: Speculator | None = None):
        self.scheduler, self.kv, self.steps, self.runner = scheduler, kv, steps, runner
        self.groups, self.outputs, self.retained, self.guard = groups, outputs, retained, guard
        self.async_scheduling = async_scheduling
        self.send_step = send_step  # the step to the tensor-parallel workers, before rank 0 launches it
        self.speculator = speculator  # drafts for the running requests before each schedule (None: off)
        self.in_flight = None  # (scheduler output, launched step) of a step whose results are not applied yet
        self.num_steps = 0
        self.num_tokens_computed = 0  # every token that went through the model, all steps
        self.last_step_num_tokens = 0
        # as vLLM counts them, whether its caller streams or not: a request's prompt once its prefill is
        # done (once per request, not per sample), and every token sampled into a sequence, as it comes
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps_left_running = 0  # steps whose successor was launched before their results were applied
        # the last step scheduled nothing: its waiting requests need blocks that other models' requests
        # hold (a shared arena); the engine loop raises when every engine is so stalled
        self.stalled = False

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished() or self.outputs.pending or self.in_flight is not None

    def run_step(self) -> list[RequestOutput]:
        """One scheduler step (only `LLMEngine.step`, called by the engine loop, calls it); see the
        module's docstring."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
            if self.runner.capture is not None or self.speculator.capture is not None:
                self.runner.capture = self.speculator.step_capture
        sched = self.scheduler.schedule()
        self.last_step_num_tokens = sched.num_tokens
        self.stalled = False
        if not sched:
            return self._idle_step(sched)
        self.num_steps += 1
        self.num_tokens_computed += sched.num_tokens
        step = self.steps.build(sched)
        started = time.perf_counter()
        with self.guard:
            if self.send_step is not None:
                self.send_step(step)
            launched = self.runner.launch(step)
        earlier = self._land_in_flight() if self.in_flight is not None else self.outputs.flush()
        if self._may_leave_running(sched):
            self._advance(sched)
            self.num_steps_left_running += 1
            self.in_flight = (sched, launched)
            return earlier
        outputs = self._wait_and_apply(sched, launched, advanced=False)
        if self.speculator is not None:
            self.speculator.observe_step(sched.num_tokens, time.perf_counter() - started)
            self.speculator.retain(self.scheduler.running)  # (draft KV of requests that ended goes at once)
        return earlier + outputs

    def drop_unwanted_in_flight(self) -> None:
        """After an abort: a step in flight that only aborted requests wait on ends unread."""
        if self.in_flight is not None and all(item.request.is_finished for item in self.in_flight[0].scheduled):
            self.in_flight = None

    def _idle_step(self, sched) -> list[RequestOutput]:
        if self.in_flight is not None:
            return self._land_in_flight()
        scheduler = self.scheduler
        if scheduler.waiting and not scheduler.running and not sched.preempted and not sched.yielded:
            if not self.kv.pool.num_in_use_by_others(self.kv.owner):
                raise RuntimeError(f"KV pool exhausted: {len(scheduler.waiting)} request(s) wait and none can be "
                                   f"scheduled ({self.kv.pool.num_free} of {self.kv.pool.num_blocks} blocks free)")
            self.stalled = True  # another model's requests hold the blocks: they free them as they end
        return self.outputs.flush()

    def _may_leave_running(self, sched) -> bool:
        """Async scheduling, some request samples this step, none is prefill-only (a verifier's
        readouts come back at once), and none needs its token on the host before its next step
        can be built (a grammar's next mask, penalties' token counts, bad words' tails)."""
        if not self.async_scheduling or any(item.request.prefill_only or item.num_draft_tokens
                                            for item in sched.scheduled):
            return False
        sampling = [item.request for item in sched.scheduled if item.completes_sequence]
        return bool(sampling) and not any(r.matcher is not None or penalized(r.sampling_params)
                                          or r.sampling_params.bad_words_token_ids for r in sampling)

    def _advance(self, sched) -> None:
        """What the next schedule must see of a step left running: its tokens computed (any later
        step that reads or reuses their blocks runs after this one on the device), and the token
        each request samples, in flight."""
        for item in sched.scheduled:
            request = item.request
            if not request.is_finished:
                samples = item.completes_sequence  # (read before the tokens count as computed)
                self._computed(request, item.num_new_tokens)
                request.num_in_flight += samples

    def _land_in_flight(self) -> list[RequestOutput]:
        """Waits for the step left running and applies its results; their outputs, text made."""
        (sched, launched), self.in_flight = self.in_flight, None
        return self._wait_and_apply(sched, launched, advanced=True) + self.outputs.flush()

    def _wait_and_apply(self, sched, launched, advanced: bool) -> list[RequestOutput]:
        with self.guard:
            result = self.runner.wait(launched)
        return self.outputs.outputs_of(self._apply(sched, result, advanced))

    def _apply(self, sched, result, advanced: bool) -> dict[str, RequestGroup]:
        """The step's results into the requests (computed tokens unless `advanced` counted them,
        logits, sampled tokens, finishes); returns the groups it touched. A request finished
        meanwhile (aborted, or ended by the step before) takes nothing."""
        if result.hidden_rows is not None:
            self.speculator.observe_hidden(result.hidden_rows, {i.request.request_id: i.request for i in sched.scheduled})
        for req_id, position, logits in result.readouts:
            self.steps.request(req_id).prompt_logits[position] = logits
        for req_id, position, entry in result.prompt_logprobs:
            request = self.steps.request(req_id)
            request.prompt_logprobs[position] = self.outputs.processor.decoded_logprobs(
                entry, request.sampling_params.detokenize)
        touched: dict[str, RequestGroup] = {}
        for item in sched.scheduled:
            request = item.request
            if request.is_finished:
                continue
            group = self.groups.of(request.request_id)
            touched[group.request_id] = group
            if item.num_draft_tokens:
                self._apply_speculated(request, group, item.num_draft_tokens, result.accepted[request.request_id])
                continue
            self._computed(request, 0 if advanced else item.num_new_tokens)
            if request.prefill_only:
                if request.num_computed_tokens == request.num_tokens:
                    self._finish_prefill(group, request)
            elif request.request_id in result.sampled:
                request.num_in_flight -= advanced
                self._append_token(request, group, *result.sampled[request.request_id])
        return touched

    def _apply_speculated(self, request: Request, group: RequestGroup, num_drafts: int, emitted: list) -> None:
        """A verified step: the last known token and the kept drafts are computed (the rejected
        drafts' slots are written over later, their blocks returned now), the emitted tokens are
        appended until one ends the sequence."""
        self.speculator.verified(request, num_drafts, len(emitted) - 1)
        request.spec_token_ids = []
        for token_id, logprobs in emitted:
            self._append_token(request, group, token_id, logprobs)
            if request.is_finished:
                return
        self._computed(request, len(emitted))  # (after the append: the kept drafts' blocks hash their tokens)
        self.kv.trim(request)

    def _computed(self, request: Request, num_new_tokens: int) -> None:
        """Tokens the device computed (or is computing, ahead of any step that reads them)."""
        request.num_computed_tokens += num_new_tokens
        self.kv.cache_full_blocks(request)
        self.kv.free_behind_window(request)

    def _append_token(self, request: Request, group: RequestGroup, token_id: int, logprobs: dict | None) -> None:
        if not group.prompt_counted:
            self._count_prompt(group)
        self.num_generation_tokens += 1
        reason, stop_reason = self.outputs.append_token(request, group, token_id, logprobs)
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)

    def _count_prompt(self, group: RequestGroup) -> None:
        self.num_prompt_tokens += len(group.prompt_token_ids)
        group.prompt_counted = True

    def _finish_prefill(self, group: RequestGroup, request: Request) -> None:
        if request is group.shared_prefill:  # (its prompt counts at its samples' first token)
            group.first_scheduled_time = request.first_scheduled_time
            # vLLM fans n samples out into n requests that each look the prompt up: the first finds what
            # this prefill's lookup found (of all but the last token, which no lookup may hit), the
            # others every token this prefill computed
            samples = len(group.children)
            self.kv.record_reused(1 + (samples - 1) * len(group.prompt_token_ids),
                                  (samples - 1) * request.num_computed_tokens)
            for child in group.children:
                self.kv.fork(request, child)
                child.num_cached_tokens = request.num_cached_tokens
                self.groups.add_member(child.request_id, group)
                self.scheduler.add(child)
            self.groups.drop_member(request.request_id)
            group.shared_prefill = None
        else:
            self._count_prompt(group)
        if request.keep_kv:
            self.scheduler.finish(request, "prefill", keep_blocks=True)
            self.retained.keep(group.request_id, request)
            return
        self.scheduler.finish(request, "prefill")
