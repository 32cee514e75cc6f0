"""Runs a strategy over many problems on the engines, the fast way.

Continuous problem batching: up to `max_problems_in_flight` problems advance together and a
finished problem is replaced at once. Every action a problem yields goes straight to its engine:
samples become generator requests that continue the beam's token ids (n samples of a beam share
its prefix through copy-on-write forks, and beams share their history through the prefix cache);
scores become verifier requests on top of the kept or cached conversation prefix, behind a score
cache. One loop steps the generator and the verifier in turn, so both always have work.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import RequestOutput
from treeserve.runtime.scorer import StepScorer
from treeserve.sampling_params import SamplingParams
from treeserve.search.config import STEP_DELIMITER, SearchConfig
from treeserve.search.prompting import prompt_token_ids
from treeserve.search.strategies import Strategy, run_strategy
from treeserve.search.tree import Sample, Score, SearchResult, Step, step_from_completion


@dataclass
class _Problem:
    index: int
    question: str
    strategy: Strategy
    prompt_ids: list[int]
    started: float
    action: Sample | Score | None = None
    sampled: dict[int, list[Step]] = field(default_factory=dict)  # beam index -> its continuations
    score_items: list[tuple[str, list[str]]] = field(default_factory=list)


class SearchRunner:
    def __init__(self, generator: LLMEngine, scorer: StepScorer | None, max_problems_in_flight: int = 32,
                 on_other_output: Callable[[RequestOutput], None] | None = None):
        self.generator = generator
        self.scorer = scorer
        self.max_problems_in_flight = max_problems_in_flight
        self.on_other_output = on_other_output  # outputs of requests that are not ours (the server's)
        self._ids = itertools.count()
        self._requests: dict[str, tuple[_Problem, int]] = {}  # generator request id -> (problem, beam)

    def run(self, questions: list[str], config: SearchConfig,
            on_result: Callable[[int, SearchResult], None] | None = None) -> list[SearchResult]:
        if config.uses_verifier and self.scorer is None:
            raise ValueError(f"verifier: strategy {config.strategy!r} needs a verifier model")
        try:
            return self._run(questions, config, on_result)
        except BaseException:
            self._cancel()
            raise

    def _cancel(self) -> None:
        """A search that fails midway leaves nothing behind: its requests are aborted."""
        for request_id in self._requests:
            self.generator.abort_request(request_id)
        self._requests.clear()
        if self.scorer is not None:
            self.scorer.cancel_pending()

    def _run(self, questions: list[str], config: SearchConfig,
             on_result: Callable[[int, SearchResult], None] | None) -> list[SearchResult]:
        results: list[SearchResult | None] = [None] * len(questions)
        queue = deque(enumerate(questions))
        in_flight: list[_Problem] = []
        while queue or in_flight:
            while queue and len(in_flight) < self.max_problems_in_flight:
                problem = self._start(*queue.popleft(), config)
                self._advance(problem, None, config, in_flight, results, on_result)
            stepped = self._step_engines()
            ready = [p for p in in_flight if self._action_done(p)]
            if not stepped and not ready and in_flight:
                raise RuntimeError("search: problems wait on requests that no engine holds")
            for problem in ready:
                in_flight.remove(problem)
                self._advance(problem, self._action_result(problem), config, in_flight, results, on_result)
        return results  # type: ignore[return-value]

    # ---- problem lifecycle -----------------------------------------------------------------
    def _start(self, index: int, question: str, config: SearchConfig) -> _Problem:
        ids = prompt_token_ids(self.generator.tokenizer, question, config)
        return _Problem(index, question, run_strategy(question, config, index), ids, time.perf_counter())

    def _advance(self, problem: _Problem, value, config, in_flight, results, on_result) -> None:
        try:
            action = problem.strategy.send(value)
        except StopIteration as stop:
            result: SearchResult = stop.value
            result.seconds = time.perf_counter() - problem.started
            results[problem.index] = result
            if on_result is not None:
                on_result(problem.index, result)
            return
        problem.action = action
        if isinstance(action, Sample):
            self._submit_sample(problem, action, config)
        else:
            self._submit_score(problem, action)
        in_flight.append(problem)

    def _action_done(self, problem: _Problem) -> bool:
        action = problem.action
        if isinstance(action, Sample):
            return len(problem.sampled) == len(action.beams)
        return self.scorer.is_ready(problem.score_items)

    def _action_result(self, problem: _Problem) -> list:
        action = problem.action
        if isinstance(action, Sample):
            return [problem.sampled[i] for i in range(len(action.beams))]
        return action.reply(self.scorer.results(problem.score_items))

    # ---- engines -----------------------------------------------------------------------------
    def _submit_sample(self, problem: _Problem, action: Sample, config: SearchConfig) -> None:
        problem.sampled = {}
        room = self.generator.max_model_len
        for i, (beam, count, seed) in enumerate(zip(action.beams, action.counts, action.seeds)):
            ids = problem.prompt_ids + beam.token_ids
            max_tokens = min(config.max_tokens, room - len(ids))
            if max_tokens < 1:
                problem.sampled[i] = [Step("", [], "length")] * count
                continue
            params = SamplingParams(n=count, temperature=0.0 if action.greedy else config.temperature,
                                    top_p=1.0 if action.greedy else config.top_p, max_tokens=max_tokens, seed=seed,
                                    stop=None if action.to_end else [STEP_DELIMITER],
                                    include_stop_str_in_output=True)
            request_id = f"search-{next(self._ids)}"
            self._requests[request_id] = (problem, i)
            self.generator.add_request(request_id, ids, params)

    def _submit_score(self, problem: _Problem, action: Score) -> None:
        problem.score_items = action.items()
        if problem.score_items:
            self.scorer.submit(problem.score_items)

    def _step_engines(self) -> bool:
        stepped = False
        if self.generator.has_unfinished_requests():
            stepped = True
            for output in self.generator.step():
                self._route_generated(output)
        if self.scorer is not None and self.scorer.has_pending:
            stepped = True
            for output in self.scorer.engine.step():
                if not self.scorer.collect(output) and self.on_other_output is not None:
                    self.on_other_output(output)
        return stepped

    def _route_generated(self, output: RequestOutput) -> None:
        owner = self._requests.get(output.request_id)
        if owner is None:
            if self.on_other_output is not None:
                self.on_other_output(output)
            return
        if not output.finished:
            return
        del self._requests[output.request_id]
        problem, beam = owner
        problem.sampled[beam] = [self._as_step(c) for c in output.outputs]

    def _as_step(self, completion) -> Step:
        step = step_from_completion(completion)
        if step.finish == "step" and self.generator.tokenizer.decode(step.token_ids) != step.text:
            # the delimiter ended inside a token: continue from the text that was kept
            step.token_ids = self.generator.tokenizer.encode(step.text, add_special_tokens=False)
        return step
