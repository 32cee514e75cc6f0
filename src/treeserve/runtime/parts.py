"""What a Runtime owns and frees: its engines, the KV spaces they run on, the models it loaded, its
telemetry trace and its tensor-parallel workers.

The Runtime holds its parts, and so does each engine it built (`LLMEngine.owner`): an engine its caller
keeps (`eng = Runtime(...).engine("gen")`, a step scorer, a search runner over it) keeps the memory it
runs on, as an `LLM`'s engine kept after `del llm` does (vLLM's too). Dropped at once, the Runtime used
to close that engine under its holder (EngineClosedError at its first request). The parts are closed by
`Runtime.close()`, or once neither the Runtime nor any of its engines is referenced (when the garbage
collector finds them: the engines refer to one another through their reclaim callbacks), or at the
interpreter's exit.
"""
from __future__ import annotations

import weakref

from treeserve.engine.kv_space import KVSpace
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.loaded_model import LoadedModel
from treeserve.runtime.telemetry import TelemetryTrace


class RuntimeParts:
    def __init__(self, executor=None):
        self.executor = executor  # the tensor-parallel workers it started (None: none)
        self.trace: TelemetryTrace | None = None
        self.engines: dict[str, LLMEngine] = {}
        self.spaces: list[KVSpace] = []  # the KV spaces it made
        self.loaded: list[LoadedModel] = []  # the models it loaded (those given loaded are their caller's)
        self.closed = False
        # (at the interpreter's exit, parts still referenced are closed: the trace flushed, the workers stopped)
        weakref.finalize(self, _close_if_alive, weakref.ref(self))

    def close(self) -> None:
        """The trace and the engines closed (each after a step under way), then the memory no engine
        runs on any more freed (a close from the stepping thread, mid-step: as that step ends) and the
        workers stopped. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.trace:
            self.trace.close()
        for engine in self.engines.values():
            engine.close()
        _when_closed(list(self.engines.values()), lambda: _free(self.spaces, self.loaded, self.executor))

    def __del__(self) -> None:
        self.close()


def _close_if_alive(parts: weakref.ref) -> None:
    alive = parts()
    if alive is not None:
        alive.close()


def _when_closed(engines: list[LLMEngine], fn) -> None:
    """`fn` once every engine's `close` has run."""
    if not engines:
        fn()
    else:
        engines[0].after_close(lambda: _when_closed(engines[1:], fn))


def _free(spaces: list[KVSpace], loaded: list[LoadedModel], executor) -> None:
    for space in spaces:
        space.release()
    for model in loaded:
        model.release_weights()
    if executor is not None:
        executor.shutdown()
