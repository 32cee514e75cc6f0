"""The engine loop: the one owner that steps engines, as vLLM's EngineCore is.

Everything else (the offline `LLM`, the PRM scorer, the search runner, the server) submits requests
through the loop with a callback for their outputs, and is polled between steps to make progress
(resume a search problem whose samples arrived, start a queued one). `LLMEngine.step()` is called
here and nowhere else, so one set of observers (Prometheus metrics, JSONL telemetry) sees every
step whatever caused it, and one abort path frees a request's KV blocks between two steps.
"""
from __future__ import annotations

import logging
import weakref
from typing import Callable, Iterable, Protocol

from treeserve.errors import ParamError
from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import AbortedRequest, RequestOutput
from treeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Loop passes in a row in which every engine with work was stalled (waiting on blocks that another
# model holds) before the loop calls it a deadlock: nothing that runs can free those blocks.
STALLED_PASSES = 2

OutputCallback = Callable[[RequestOutput], None]
StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]
AbortObserver = Callable[[LLMEngine, AbortedRequest], None]  # what the request had done when cut
IdleObserver = Callable[[LLMEngine], None]


class LoopClient(Protocol):
    """A state machine driven by the loop (a search runner, a scorer with waiting callers)."""

    def poll(self) -> None:
        """Makes all the progress possible without a step: consume what arrived, submit what is next."""


Engines = LLMEngine | dict[str, LLMEngine] | Iterable[LLMEngine]
_LOOP_OF: weakref.WeakValueDictionary[int, "EngineLoop"] = weakref.WeakValueDictionary()  # id(engine) -> its loop


class EngineLoop:
    """One per engine: made where the engine is made (`LLM`, `Runtime`, the server's launch); the
    scorer, the search runner and the async engine take that one with `EngineLoop.of`."""

    def __init__(self, engines: Engines):
        self.engines: list[LLMEngine] = _engine_list(engines)
        driven = [e for e in self.engines if id(e) in _LOOP_OF]
        if driven:
            raise RuntimeError(f"engine {_engine_name(driven[0])!r} is already driven by an engine loop: take "
                               "that one (EngineLoop.of) instead of making another")
        for engine in self.engines:
            _LOOP_OF[id(engine)] = self
        self.step_observers: list[StepObserver] = []
        self.abort_observers: list[AbortObserver] = []
        self.idle_observers: list[IdleObserver] = []  # see `step`
        self.clients: list[LoopClient] = []
        self._owners: dict[tuple[int, str], OutputCallback] = {}
        self.num_steps = 0  # loop iterations that stepped at least one engine
        self._stalled_passes = 0

    @classmethod
    def of(cls, engines: Engines) -> EngineLoop:
        """The loop that drives these engines; a new one where none drives any of them."""
        engines = _engine_list(engines)
        loops = [_LOOP_OF.get(id(e)) for e in engines]
        if all(loop is None for loop in loops):
            return cls(engines)
        if any(loop is not loops[0] for loop in loops):
            raise RuntimeError("these engines are driven by different engine loops (or some by none): "
                               "one loop must step them all")
        return loops[0]

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, engine: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    on_output: OutputCallback, **options) -> None:
        """Queues a request on `engine` (see `LLMEngine.add_request` for `options`); its outputs go
        to `on_output`, the last one with `finished` set."""
        self._require_engine(engine)
        engine.add_request(request_id, prompt_token_ids, params, **options)
        self._owners[(id(engine), request_id)] = on_output

    def abort_request(self, engine: LLMEngine, request_id: str) -> bool:
        """Aborts a request and frees its KV blocks now; False when it had already finished (with
        async output processing its last output may still be on its way: it is delivered)."""
        group = engine.groups.get(request_id)
        if group is None or group.finished:
            if group is None:
                self._owners.pop((id(engine), request_id), None)
            return False
        self._owners.pop((id(engine), request_id), None)
        aborted = engine.abort_request(request_id)
        for observe in self.abort_observers:
            observe(engine, aborted)
        return True

    def owns(self, engine: LLMEngine, request_id: str) -> bool:
        return (id(engine), request_id) in self._owners

    def add_client(self, client: LoopClient) -> None:
        if client not in self.clients:
            self.clients.append(client)

    def remove_client(self, client: LoopClient) -> None:
        if client in self.clients:
            self.clients.remove(client)

    # ---- stepping -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> bool:
        """Polls the clients, then steps every engine that has work once and routes the outputs.
        Returns whether any engine ran.

        The idle observers see every engine that did not step: what changed its KV outside a step
        (a scorer releasing kept blocks as the last output arrived, a job run between steps) is
        then seen without waiting for that engine's next step."""
        self.poll_clients()
        busy = [e for e in self.engines if e.has_unfinished_requests()]
        for engine in busy:
            self._step_engine(engine)
        self._check_stalled(busy)
        for engine in (e for e in self.engines if self.idle_observers and e not in busy):
            for observe in self.idle_observers:
                observe(engine)
        if busy:
            self.num_steps += 1
        return bool(busy)

    def _check_stalled(self, busy: list[LLMEngine]) -> None:
        """An engine whose waiting requests need blocks that another model's requests hold waits for
        them to end, and the engines sharing its pool admit nothing new meanwhile (`stalled_owners`);
        when every engine with work waits so, none ever will."""
        for engine in self.engines:
            engine.kv.pool.stalled_owners.discard(engine.kv.owner)
        for engine in busy:
            if engine.is_stalled:
                engine.kv.pool.stalled_owners.add(engine.kv.owner)
        if not busy or not all(e.is_stalled for e in busy):
            self._stalled_passes = 0
            return
        self._stalled_passes += 1
        if self._stalled_passes >= STALLED_PASSES:
            self._stalled_passes = 0
            waiting = ", ".join(f"{_engine_name(e)}: {e.stats().num_waiting}" for e in busy)
            raise RuntimeError(f"KV pool exhausted: every model sharing it waits for blocks the others hold "
                               f"(waiting requests {waiting}); give the arena more memory")

    def check_health(self) -> None:
        """Raises what stopped any engine (a tensor-parallel worker's death, say)."""
        for engine in self.engines:
            engine.check_health()

    def poll_clients(self) -> None:
        for client in list(self.clients):
            client.poll()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Steps until `done()`; raises when nothing is left to step and it is still not done."""
        while not done():
            if not self.step():
                self.poll_clients()
                if not done():
                    raise RuntimeError("engine loop: waiting on requests that no engine holds")

    def _step_engine(self, engine: LLMEngine) -> None:
        outputs = engine.step()
        for observe in self.step_observers:
            observe(engine, outputs)
        key = id(engine)
        for output in outputs:
            callback = self._owners.get((key, output.request_id))
            if output.finished:
                self._owners.pop((key, output.request_id), None)
            if callback is None:
                logger.warning("engine loop: output for %r, which nobody awaits, dropped", output.request_id)
                continue
            callback(output)

    def _require_engine(self, engine: LLMEngine) -> None:
        if not any(e is engine for e in self.engines):
            raise ParamError("engine", f"{_engine_name(engine)!r} is not driven by this loop")


def _engine_list(engines: Engines) -> list[LLMEngine]:
    if isinstance(engines, LLMEngine):
        return [engines]
    return list(engines.values() if isinstance(engines, dict) else engines)


def _engine_name(engine: LLMEngine) -> str:
    return engine.name or engine.model_dir.name
