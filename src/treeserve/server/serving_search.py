"""POST /v1/search and POST /v1/rewards, served on the engine loop.

Every search joins the generator's one `SearchRunner`: problems from all concurrent requests
advance together (continuous problem batching), up to its bound in flight and queued past it; past
`--max-queue` queued, a new search gets 429. Chats and completions keep flowing meanwhile: the loop
steps their requests in the same batches. With `"stream": true` the response is Server-Sent Events:
progress events, then the result. A client that leaves (a closed stream, or a disconnect while it
waits for the JSON answer) has its search cancelled on the engine thread before the next step:
its generator and verifier requests are aborted and their KV freed.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from treeserve import jsonl
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.errors import ParamError
from treeserve.runtime.scorer import StepScorer, given_question
from treeserve.search.config import DEFAULT_AGG_STRATEGY, SAL_SYSTEM_PROMPT, SearchConfig, declared_aggregation
from treeserve.search.progress import SearchProgress
from treeserve.search.runner import SearchHandle, SearchRunner
from treeserve.search.tree import SearchResult
from treeserve.wire.chat_messages import template_messages
from treeserve.wire.disconnect import unless_client_leaves
from treeserve.wire.errors import APIError, failure_body, from_value_error
from treeserve.wire.search import SearchRequest



def question_and_system(body: SearchRequest) -> tuple[str, str | None]:
    if (body.question is None) == (body.messages is None):
        raise APIError(400, "question: give exactly one of 'question' and 'messages'", param="question")
    system = body.system_prompt if body.system_prompt is not None else SAL_SYSTEM_PROMPT
    if body.question is not None:
        return _asked(body.question, "question"), system or None
    try:
        messages = template_messages(body.messages)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise APIError(400, "messages: needs a user message holding the question", param="messages")
    systems = [m["content"] for m in messages if m["role"] == "system"]
    return _asked(users[-1], "messages"), (systems[-1] if systems else system) or None


def _asked(question: str, param: str) -> str:
    """search's check of the question, as a 400 naming `param`."""
    try:
        return given_question(question, param)
    except ParamError as exc:
        raise from_value_error(exc) from None


# SearchConfig's fields a body leaves to the server (None on the wire); every other field of
# SearchConfig is copied from the body's field of the same name.
SERVER_CHOSEN = ("beam_width", "agg_strategy", "system_prompt")


def search_config(body: SearchRequest, system: str | None, aggregation: str = DEFAULT_AGG_STRATEGY) -> SearchConfig:
    values = {f.name: getattr(body, f.name) for f in dataclasses.fields(SearchConfig) if f.name not in SERVER_CHOSEN}
    beam_width = body.beam_width if body.beam_width is not None else min(4, body.n)
    try:
        return SearchConfig(**values, beam_width=beam_width, agg_strategy=body.agg_strategy or aggregation,
                            system_prompt=system)
    except ValueError as exc:
        raise from_value_error(exc) from exc


def _verifier_missing(strategy: str, served: list[str]) -> APIError:
    """A search that ranks by step scores, sent with no `verifier` (an unknown one is a 404 before this)."""
    if served:
        fix = f"name one of the served reward models: {', '.join(served)}"
    else:
        fix = "this server serves none: start it with one (--model prm=PATH)"
    return APIError(400, f"verifier: this field is required: strategy '{strategy}' ranks its candidates by a reward "
                         f"model's step scores ({fix}); greedy and majority need none", param="verifier",
                    code="missing_required_parameter")


class SearchServing:
    """Served search for one generator, and scoring for the served reward models."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, runner: SearchRunner,
                 scorers: dict[str, StepScorer]):
        self.engine = engine
        self.model_name = model_name
        self.runner = runner
        self.scorers = scorers
        # where a request names no agg_strategy: the one each reward model's config.json declares
        self.aggregations = {name: declared_aggregation(s.engine.model_dir) for name, s in scorers.items()}

    async def search(self, body: SearchRequest, request: Request):
        question, system = question_and_system(body)
        scorer, config = self._scorer_and_config(body, system)
        self._check_capacity()
        events = self._events(question, config, scorer, progress=body.stream)
        verifier = body.verifier if scorer else None
        if body.stream:
            first = await _first(events)  # errors before the search starts are still plain HTTP errors
            return StreamingResponse(self._sse(first, events, verifier, config), media_type="text/event-stream")
        result = await self._wait_for_result(events, request)
        return JSONResponse(search_response(self.model_name, verifier, config, result))

    # ---- helpers ---------------------------------------------------------------------------
    def _scorer_and_config(self, body: SearchRequest, system: str | None) -> tuple[StepScorer | None, SearchConfig]:
        scorer = self.scorers.get(body.verifier) if body.verifier is not None else None
        aggregation = self.aggregations[body.verifier] if scorer else DEFAULT_AGG_STRATEGY
        config = search_config(body, system, aggregation)
        try:
            self.runner.generator.speculator.check(config.speculative_config)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        if not config.uses_verifier:
            return None, config
        if scorer is None:
            raise _verifier_missing(config.strategy, list(self.scorers))
        return scorer, config

    def _check_capacity(self) -> None:
        """A fast refusal; the exact check runs with the submission, on the engine thread."""
        if self.engine.errored is not None:
            raise APIError(503, f"the engine has failed ({self.engine.errored}); restart the server",
                           code="engine_dead")
        if self._queue_full():
            raise _queue_full_error(self.engine.max_queue)

    def _queue_full(self) -> bool:
        limit = self.engine.max_queue
        return limit is not None and self.runner.num_backlogged >= limit

    async def _events(self, question: str, config: SearchConfig, scorer: StepScorer | None,
                      progress: bool) -> AsyncIterator[dict | SearchResult]:
        """Progress events (dicts; only with `progress`), then the SearchResult; leaving early
        cancels the search."""
        stream_id = self.engine.new_request_id("search")
        stream = self.engine.open_stream(stream_id)

        def on_done(handle: SearchHandle) -> None:
            self.engine.push(stream_id, handle.error or handle.result, final=True)

        submitted: list[SearchHandle] = []

        def submit() -> SearchHandle | None:
            if self._queue_full():  # on the engine thread, so concurrent requests cannot overshoot
                return None
            on_progress = (lambda p: self.engine.push(stream_id, p.as_event())) if progress else None
            submitted.append(self.runner.submit(question, config, scorer=scorer, on_done=on_done,
                                                on_progress=on_progress))
            return submitted[0]

        def cancel() -> None:  # posted after `submit`, so it runs after it on the engine thread
            for search in submitted:
                self.runner.cancel(search)
        handle = None
        try:
            handle = await self.engine.run_job(submit)
            if handle is None:
                raise _queue_full_error(self.engine.max_queue)
            yield SearchProgress().as_event()  # accepted (it may wait in the queue before it starts)
            async for item in self.engine.stream_items(stream, lambda item: isinstance(item, SearchResult)):
                yield item
        except ValueError as exc:
            raise from_value_error(exc) from exc
        finally:
            self.engine.close_stream(stream_id)
            if handle is None or not handle.done:  # None: the client left before the submission came back
                with contextlib.suppress(RuntimeError):  # a dead engine has nothing left to cancel
                    self.engine.post(cancel)

    async def _wait_for_result(self, events: AsyncIterator, request: Request) -> SearchResult:
        """The result; a client that disconnects first gets its search cancelled, unless it sent an
        Idempotency-Key (wire/disconnect.py)."""
        async def last() -> SearchResult:
            item = None
            async for item in events:
                pass
            return item
        try:
            return await unless_client_leaves(request, last(), "search")
        finally:
            with contextlib.suppress(BaseException):
                await events.aclose()

    async def _sse(self, first, events: AsyncIterator, verifier: str | None, config: SearchConfig):
        try:
            item = first
            while True:
                if isinstance(item, SearchResult):
                    yield _sse_line(search_response(self.model_name, verifier, config, item))
                    break
                yield _sse_line(item)
                item = await events.__anext__()
        except Exception as exc:  # the stream has started: the error is its last event
            yield _sse_line(failure_body(exc))
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"


def _queue_full_error(limit: int | None) -> APIError:
    return APIError(429, f"the search queue is full ({limit} searches wait); retry later", code="queue_full",
                    headers={"Retry-After": "1"})


async def _first(events: AsyncIterator):
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("search: ended without a result") from None


def _sse_line(payload: dict) -> str:
    return f"data: {jsonl.line(payload)}\n\n"


def search_response(model: str, verifier: str | None, config: SearchConfig, result: SearchResult) -> dict:
    """The reply; scores are null where the strategy reads no verifier (greedy, majority): a 0 would
    say the verifier judged the answer wrong, as `treeserve search` prints `score: none` then."""
    scores = result.reported_agg_scores
    candidates = [{"index": i, "text": text, "answer": answer, "score": score, "step_scores": steps}
                  for i, (text, answer, score, steps) in enumerate(zip(result.completions, result.answers,
                                                                      scores, result.scores))]
    return {"object": "search.result", "model": model, "verifier": verifier, "strategy": config.strategy,
            "n": config.num_candidates, "answer": result.pred, "completion": result.completions[result.chosen],
            "score": scores[result.chosen], "verifier_rejected_all": result.verifier_rejected_all,
            "chosen": result.chosen, "candidates": candidates,
            "tree_size": result.tree_size, "usage": result.usage,
            "seconds": round(result.seconds, 4)}
