"""One engine loop on a background thread; per-request async output streams for the server.

The loop drives every engine it holds (one per model) in turn. It takes new requests, aborts and
jobs between steps, so an abort (for example a client that disconnected) frees its KV blocks
before the next step runs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import RequestOutput
from treeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    engine: LLMEngine


@dataclass
class _Job:
    fn: Callable[[], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class AsyncLLMEngine:
    def __init__(self, engines: LLMEngine | dict[str, LLMEngine], max_queue: int | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_abort: Callable[[LLMEngine, str], None] | None = None):
        self.engines = engines if isinstance(engines, dict) else {"": engines}
        self.engine = next(iter(self.engines.values()))  # the first (or only) model
        self.max_queue = max_queue
        self.on_step = on_step
        self.on_abort = on_abort
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._jobs: list[_Job] = []
        self._engine_of: dict[str, LLMEngine] = {}
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.errored: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="treeserve-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop --------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_waiting(self) -> int:
        return sum(len(e.scheduler.waiting) for e in self.engines.values()) + len(self._new)

    async def run_job(self, fn: Callable[[], object]):
        """Runs `fn` on the engine thread between steps (e.g. PRM scoring that drives an engine)."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop, loop.create_future())
        with self._lock:
            self._jobs.append(job)
        self._wake.set()
        return await job.future

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, engine: LLMEngine | None = None) -> AsyncIterator[RequestOutput]:
        """Streams cumulative outputs; leaving the iterator early aborts the request."""
        engine = engine or self.engine
        engine.validate_prompt(prompt_token_ids)
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[request_id] = stream
            self._engine_of[request_id] = engine
            self._new.append(_NewRequest(request_id, list(prompt_token_ids), params, prompt, engine))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._aborts.append(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._take_inbox()
                busy = [e for e in self.engines.values() if e.has_unfinished_requests()]
                if not busy:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for engine in busy:
                    self._step(engine)
        except BaseException as exc:  # keep serving errors visible instead of hanging clients
            logger.exception("engine loop failed")
            self.errored = exc
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, RuntimeError(f"engine failure: {exc}"))

    def _step(self, engine: LLMEngine) -> None:
        outputs = engine.step()
        if self.on_step is not None:
            self.on_step(engine, outputs)
        self.deliver_outputs(outputs)

    def deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._deliver(output.request_id, output)

    def deliver_outputs_one(self, output: RequestOutput) -> None:
        self._deliver(output.request_id, output)

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            jobs, self._jobs = self._jobs, []
        for item in new:
            try:
                item.engine.add_request(item.request_id, item.prompt_token_ids, item.params, prompt=item.prompt)
            except Exception as exc:
                self._deliver(item.request_id, exc)
        for request_id in aborts:
            engine = self._engine_of.pop(request_id, None)
            if engine is not None and request_id in engine.groups:
                engine.abort_request(request_id)
                if self.on_abort is not None:
                    self.on_abort(engine, request_id)
        for job in jobs:
            self._run_job(job)

    @staticmethod
    def _run_job(job: _Job) -> None:
        try:
            result = job.fn()
        except Exception as exc:
            job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
        else:
            job.loop.call_soon_threadsafe(_settle, job.future, result, None)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
                self._engine_of.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
