"""Runs a strategy over many problems on the engines, the fast way.

Continuous problem batching: up to `max_problems_in_flight` problems advance together and a
finished problem is replaced at once, from one queue that offline runs and every served request
feed alike. Every action a problem yields goes straight to its engine: samples become generator
requests that continue the beam's token ids (n samples of a beam share its prefix through
copy-on-write forks, and beams share their history through the prefix cache); scores become
verifier requests on top of the kept or cached conversation prefix, behind a score cache.

The runner is a state machine on the engine loop: it submits requests with callbacks, and the loop
polls it between steps to resume the problems whose action is done. It never steps an engine.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from treeserve.errors import ParamError
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.request import BACKGROUND_PRIORITY
from treeserve.runtime.scorer import ScoreTicket, StepScorer, given_question, given_questions
from treeserve.sampling_params import SamplingParams
from treeserve.search.config import STEP_DELIMITER, SearchConfig, with_aggregation
from treeserve.search.progress import SearchProgress
from treeserve.search.prompting import prompt_token_ids
from treeserve.search.strategies import Strategy, run_strategy
from treeserve.search.tree import Sample, Score, SearchResult, Step, step_from_completion

logger = logging.getLogger(__name__)
_REQUEST_IDS = itertools.count()  # unique in the process: several runners may share an engine


@dataclass(eq=False)
class SearchHandle:
    """One problem being searched: its state, and how it ended (`result` or `error`)."""
    question: str
    config: SearchConfig
    index: int
    scorer: StepScorer | None
    on_done: Callable[["SearchHandle"], None] | None = None
    on_progress: Callable[[SearchProgress], None] | None = None
    strategy: Strategy | None = None
    prompt_ids: list[int] = field(default_factory=list)
    started: float = 0.0
    action: Sample | Score | None = None
    ready: bool = False
    sampled: dict[int, list[Step]] = field(default_factory=dict)  # beam index -> its continuations
    requests: set[str] = field(default_factory=set)  # generator requests in flight
    ticket: ScoreTicket | None = None
    progress: SearchProgress = field(default_factory=SearchProgress)
    result: SearchResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    # its generator requests' draft group: `suffix` speculation drafts from every sequence of the problem
    draft_group: str = field(default_factory=lambda: f"search-problem-{next(_REQUEST_IDS)}")

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None or self.cancelled


class SearchRunner:
    def __init__(self, generator: LLMEngine, scorer: StepScorer | None, max_problems_in_flight: int = 32,
                 loop: EngineLoop | None = None):
        if max_problems_in_flight < 1:
            raise ParamError("max_problems_in_flight", f"must be at least 1, got {max_problems_in_flight}")
        self.generator = generator
        self.scorer = scorer
        self.max_problems_in_flight = max_problems_in_flight
        self.loop = loop or (scorer.loop if scorer is not None else EngineLoop.of(generator))
        self.loop.add_client(self)
        self._queue: deque[SearchHandle] = deque()
        self._in_flight: list[SearchHandle] = []
        self.num_finished = 0
        self.num_cancelled = 0  # problems stopped before their end (a client gone, a failed batch)
        self.finished_observers: list[Callable[[SearchHandle], None]] = []

    @property
    def num_running(self) -> int:
        return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_backlogged(self) -> int:
        """Problems that will wait once the queue is polled: those past the in-flight bound."""
        return max(0, len(self._queue) + len(self._in_flight) - self.max_problems_in_flight)

    # ---- offline: a batch of problems, blocking ------------------------------------------
    def run(self, questions: list[str], config: SearchConfig,
            on_result: Callable[[int, SearchResult], None] | None = None,
            on_progress: Callable[[SearchProgress], None] | None = None) -> list[SearchResult]:
        """`on_progress` gets each problem's progress as it goes (`treeserve search` shows it)."""
        if config.uses_verifier and self.scorer is None:
            raise ParamError("verifier", f"strategy {config.strategy!r} needs a verifier model")
        questions = given_questions(questions)  # all checked before any is queued (and a generator read once)

        def finished(handle: SearchHandle) -> None:
            if handle.result is not None and on_result is not None:
                on_result(handle.index, handle.result)
        handles = [self.submit(q, config, index=i, on_done=finished, on_progress=on_progress)
                   for i, q in enumerate(questions)]
        try:
            self.loop.run_until(lambda: all(h.done for h in handles) or any(h.error for h in handles))
            failed = next((h for h in handles if h.error is not None), None)
            if failed is not None:
                failed.error.problem_index = failed.index  # (which question: the eval names its dataset row)
                raise failed.error
        except BaseException:
            for handle in handles:
                self.cancel(handle)
            raise
        return [h.result for h in handles]  # type: ignore[misc]

    # ---- the state machine ---------------------------------------------------------------
    def submit(self, question: str, config: SearchConfig, index: int = 0, scorer: StepScorer | None = None,
               on_done: Callable[[SearchHandle], None] | None = None,
               on_progress: Callable[[SearchProgress], None] | None = None) -> SearchHandle:
        """Queues one problem; it starts when fewer than `max_problems_in_flight` run. `index` is
        its place in the seed tree (`seed_for(config.seed, index, ...)`). An empty or blank question is
        a ParamError, as for `treeserve search` and /v1/search (it searched the model's noise)."""
        given_question(question)
        scorer = scorer or self.scorer
        if config.uses_verifier and scorer is None:
            raise ParamError("verifier", f"strategy {config.strategy!r} needs a verifier model")
        if scorer is not None and scorer.loop is not self.loop:
            raise ParamError("verifier", "the scorer is driven by another engine loop than the generator")
        scorer = scorer if config.uses_verifier else None
        config = with_aggregation(config, scorer.engine.model_dir if scorer is not None else None)
        handle = SearchHandle(question, config, index, scorer, on_done, on_progress)
        self._queue.append(handle)
        return handle

    def cancel(self, handle: SearchHandle) -> None:
        """Stops a problem now: its generator and verifier requests are aborted (KV freed)."""
        if handle.done:
            return
        handle.cancelled = True
        self.num_cancelled += 1
        if handle in self._queue:
            self._queue.remove(handle)
            return
        self._release(handle)

    def poll(self) -> None:
        """Starts queued problems while there is room and resumes every problem whose action is done."""
        progressed = True
        while progressed:
            progressed = False
            while self._queue and len(self._in_flight) < self.max_problems_in_flight:
                self._start(self._queue.popleft())
                progressed = True
            for handle in [h for h in self._in_flight if h.ready]:
                self._in_flight.remove(handle)
                self._resume(handle)
                progressed = True

    # ---- problem lifecycle -----------------------------------------------------------------
    def _start(self, handle: SearchHandle) -> None:
        handle.started = time.perf_counter()
        try:
            handle.prompt_ids = prompt_token_ids(self.generator.tokenizer, handle.question, handle.config)
            self.generator.validate_prompt(handle.prompt_ids)
        except Exception as exc:
            self._fail(handle, exc)
            return
        handle.strategy = run_strategy(handle.question, handle.config, handle.index)
        self._advance(handle, None)

    def _resume(self, handle: SearchHandle) -> None:
        """Hands a problem its action's result; a failure there fails that problem only."""
        try:
            value = self._action_result(handle)
        except Exception as exc:
            self._release(handle)
            self._fail(handle, exc)
            return
        self._advance(handle, value)

    def _advance(self, handle: SearchHandle, value) -> None:
        try:
            action = handle.strategy.send(value)
        except StopIteration as stop:
            self._finish(handle, stop.value)
            return
        except Exception as exc:
            self._fail(handle, exc)
            return
        handle.action, handle.ready = action, False
        self._in_flight.append(handle)
        try:
            if isinstance(action, Sample):
                self._submit_sample(handle, action)
            else:
                self._submit_score(handle, action)
        except Exception as exc:
            self._in_flight.remove(handle)
            self._release(handle)
            self._fail(handle, exc)

    def _finish(self, handle: SearchHandle, result: SearchResult) -> None:
        result.seconds = time.perf_counter() - handle.started
        result.prompt_tokens, result.verifier_tokens = len(handle.prompt_ids), handle.progress.verifier_tokens
        handle.result = result
        self.num_finished += 1
        self._notify(handle)

    def _fail(self, handle: SearchHandle, error: BaseException) -> None:
        logger.debug("search failed: %s", error)
        handle.error = error
        self._notify(handle)

    def _notify(self, handle: SearchHandle) -> None:
        for observe in self.finished_observers:
            observe(handle)
        if handle.on_done is not None:
            handle.on_done(handle)

    def _release(self, handle: SearchHandle) -> None:
        if handle in self._in_flight:
            self._in_flight.remove(handle)
        for request_id in handle.requests:
            self.loop.abort_request(self.generator, request_id)
        handle.requests.clear()
        if handle.ticket is not None and handle.scorer is not None:
            handle.scorer.cancel(handle.ticket)
            handle.ticket = None

    def _action_result(self, handle: SearchHandle) -> list:
        action = handle.action
        if isinstance(action, Sample):
            result = [handle.sampled[i] for i in range(len(action.beams))]
            handle.progress.on_sampled(action, result)
        else:
            scores = handle.ticket.results() if handle.ticket is not None else []
            handle.ticket = None
            result = action.reply(scores)
            handle.progress.on_scored(result, handle.config.agg_strategy)
        if handle.on_progress is not None:
            handle.on_progress(handle.progress)
        return result

    # ---- engines -----------------------------------------------------------------------------
    def _submit_sample(self, handle: SearchHandle, action: Sample) -> None:
        handle.sampled = {}
        config, room = handle.config, self.generator.max_model_len
        for i, (beam, count, seed) in enumerate(zip(action.beams, action.counts, action.seeds)):
            ids = handle.prompt_ids + beam.token_ids
            max_tokens = min(config.max_tokens, room - len(ids))
            if max_tokens < 1:
                handle.sampled[i] = [Step("", [], "length")] * count
                continue
            params = SamplingParams(n=count, temperature=0.0 if action.greedy else config.temperature,
                                    top_p=1.0 if action.greedy else config.top_p, max_tokens=max_tokens, seed=seed,
                                    stop=None if action.to_end else [STEP_DELIMITER],
                                    include_stop_str_in_output=True)
            request_id = f"search-{next(_REQUEST_IDS)}"
            self.loop.add_request(self.generator, request_id, ids, params, self._sample_callback(handle, i),
                                  priority=BACKGROUND_PRIORITY, final_only=True, draft_group=handle.draft_group,
                                  speculative_config=config.speculative_config)
            handle.requests.add(request_id)
        handle.ready = len(handle.sampled) == len(action.beams)

    def _sample_callback(self, handle: SearchHandle, beam: int):
        def on_output(output) -> None:
            if not output.finished:
                return
            handle.requests.discard(output.request_id)
            handle.sampled[beam] = [self._as_step(c) for c in output.outputs]
            handle.ready = len(handle.sampled) == len(handle.action.beams)
        return on_output

    def _submit_score(self, handle: SearchHandle, action: Score) -> None:
        items = action.items()
        if not items:
            handle.ready = True
            return
        scorer = handle.scorer
        before = scorer.num_prompt_tokens
        handle.ticket = scorer.submit(items, on_ready=lambda ticket: setattr(handle, "ready", True))
        handle.progress.verifier_tokens += scorer.num_prompt_tokens - before

    def _as_step(self, completion) -> Step:
        step = step_from_completion(completion)
        if step.finish == "step" and self.generator.tokenizer.decode(step.token_ids) != step.text:
            # the delimiter ended inside a token: continue from the text that was kept
            step.token_ids = self.generator.tokenizer.encode(step.text, add_special_tokens=False)
        return step
