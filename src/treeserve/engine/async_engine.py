"""The engine loop on its own thread, with per-request async output streams for the server.

The engine thread owns the `EngineLoop` (every engine it holds, one per model) and is the only
thread that touches engines, the search runner or the scorers. By default it is a background
thread; `treeserve serve` instead runs it on the process's main thread (`run_forever`) and HTTP on
a background one, because PyTorch's OpenMP pool serves the thread that first used it best: on 2
cores, small ops ran 2-3x slower from another thread once the main thread had loaded the models. The event loop hands it new requests, aborts
and short calls (`run_job`: submit a search, cancel one) through an inbox that it empties between
steps, so an abort (a client that disconnected) frees its KV blocks before the next step runs.
Results travel back through streams: asyncio queues filled with `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.request import BACKGROUND_PRIORITY
from treeserve.errors import EngineDeadError
from treeserve.outputs import AbortedRequest, RequestOutput
from treeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Job:
    fn: Callable[[], object]
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None


class AsyncLLMEngine:
    def __init__(self, engines: LLMEngine | dict[str, LLMEngine], max_queue: int | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_abort: Callable[[LLMEngine, AbortedRequest], None] | None = None, loop: EngineLoop | None = None,
                 start_thread: bool = True, on_idle: Callable[[LLMEngine], None] | None = None):
        """With `start_thread=False` the caller runs the loop itself: `run_forever()`."""
        self.engines = engines if isinstance(engines, dict) else {"": engines}
        self.engine = next(iter(self.engines.values()))  # the first (or only) model
        self.loop = loop or EngineLoop.of(self.engines)
        if on_step is not None:
            self.loop.step_observers.append(on_step)
        if on_abort is not None:
            self.loop.abort_observers.append(on_abort)
        if on_idle is not None:
            self.loop.idle_observers.append(on_idle)
        self.max_queue = max_queue
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Job] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.errored: BaseException | None = None
        self._cut: Callable[[], BaseException] | None = None  # (cut_streams: what a stream opened after gets)
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self.run_forever, name="treeserve-engine", daemon=True)
            self._thread.start()

    # ---- called from the event loop --------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_waiting(self) -> int:
        """Interactive requests waiting (search samples and verifier work queue on their own bound)."""
        with self._lock:
            queued = len(self._inbox)
        return queued + sum(1 for e in self.engines.values() for r in list(e.scheduler.waiting)
                            if r.priority < BACKGROUND_PRIORITY)

    async def run_job(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the engine thread between steps and returns its result. For short calls
        only (submitting or cancelling work): the loop does not step while it runs."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop, loop.create_future())
        self._post(job)
        return await job.future

    def post(self, fn: Callable[[], object]) -> None:
        """Runs `fn` on the engine thread between steps, without waiting (a cancellation)."""
        self._post(_Job(fn))

    def open_stream(self, stream_id: str) -> _Stream:
        """A stream that the engine thread fills with `push`; read it with `stream_items`."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.errored is not None:
                raise EngineDeadError(self.errored)
            if self._cut is not None:
                raise self._cut()
            self._streams[stream_id] = stream
        return stream

    def close_stream(self, stream_id: str) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)

    @staticmethod
    async def stream_items(stream: _Stream, is_final: Callable[[Any], bool]) -> AsyncIterator[Any]:
        """The items pushed to a stream until one that `is_final`; an exception pushed is raised."""
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if is_final(item):
                return

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, engine: LLMEngine | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (whole so far, or only what is new: `params.output_kind`);
        leaving the iterator early aborts the request. `priority`:
        the waiting queue's order (0 interactive, 1 background)."""
        engine = engine or self.engine
        prompt_token_ids = engine.truncated_prompt(prompt_token_ids, params)
        engine.validate_prompt(prompt_token_ids)
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")
        stream = self.open_stream(request_id)
        ids = list(prompt_token_ids)

        def add() -> None:
            try:
                self.loop.add_request(engine, request_id, ids, params, self._pusher(request_id), prompt=prompt,
                                      priority=priority)
            except Exception as exc:
                self.push(request_id, exc)
        self.post(add)
        finished = False
        try:
            async for output in self.stream_items(stream, lambda item: item.finished):
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def cut_streams(self, make_error: Callable[[], BaseException]) -> int:
        """Ends every open stream with an error of `make_error` (one each: an exception raised in
        several tasks would mix their tracebacks), raised to its reader, and any stream opened later
        too (the server's drain has run out of time: each reply ends with an error its client can
        read, and a request's generator, left, aborts its request); how many were open."""
        with self._lock:
            self._cut = make_error
            stream_ids = list(self._streams)
        for stream_id in stream_ids:
            self.push(stream_id, make_error(), final=True)
        return len(stream_ids)

    def abort(self, request_id: str) -> None:
        """Aborts a request of any engine before the next step (its KV blocks are freed)."""
        self.close_stream(request_id)
        self.post(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        for engine in self.engines.values():
            if self.loop.abort_request(engine, request_id):
                return

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _post(self, job: _Job) -> None:
        with self._lock:
            if self.errored is not None:
                raise EngineDeadError(self.errored)
            self._inbox.append(job)
        self._wake.set()

    # ---- the engine thread -----------------------------------------------------------------
    def push(self, stream_id: str, item: Any, final: bool | None = None) -> None:
        """Hands an item to a stream's reader (from the engine thread, or the event loop's
        `cut_streams`); an exception, a finished output, or `final=True` closes the stream."""
        if final is None:
            final = isinstance(item, BaseException) or bool(getattr(item, "finished", False))
        with self._lock:
            stream = self._streams.pop(stream_id, None) if final else self._streams.get(stream_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _pusher(self, stream_id: str) -> Callable[[RequestOutput], None]:
        return lambda output: self.push(stream_id, output)

    def run_forever(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """The engine thread's body: inbox, step, wait when idle; until `shutdown` or `should_stop()`."""
        try:
            while not self._stopped and not should_stop():
                self._take_inbox()
                if not self.loop.step():
                    self.loop.check_health()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # keep serving errors visible instead of hanging clients
            logger.exception("engine loop failed")
            with self._lock:
                self.errored = exc
                streams, jobs = list(self._streams), self._inbox
                self._inbox = []
            failure = EngineDeadError(exc)
            for stream_id in streams:
                self.push(stream_id, failure)
            for job in (j for j in jobs if j.future is not None):
                job.loop.call_soon_threadsafe(_settle, job.future, None, failure)

    def _take_inbox(self) -> None:
        with self._lock:
            jobs, self._inbox = self._inbox, []
        for job in jobs:
            self._run_job(job)

    @staticmethod
    def _run_job(job: _Job) -> None:
        try:
            result = job.fn()
        except Exception as exc:
            if job.future is None:
                logger.exception("engine-thread call failed")
            else:
                job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
        else:
            if job.future is not None:
                job.loop.call_soon_threadsafe(_settle, job.future, result, None)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
