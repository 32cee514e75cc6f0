"""What a Runtime owns and frees: the KV spaces it made, the models it loaded, its telemetry trace
and its tensor-parallel workers.

The Runtime holds its parts, and so does each engine it built (`LLMEngine.owner`): an engine its caller
keeps (`eng = Runtime(...).engine("gen")`, a step scorer, a search runner over it) keeps the memory it
runs on, as an `LLM`'s engine kept after `del llm` does (vLLM's too). The parts refer to neither (no
reference cycle: the engines' reclaim callbacks hold one another weakly, runtime/runtime.py), so plain
reference counting frees them as the last of the Runtime and its engines goes: the arena and the
weights freed, the trace closed, the workers stopped at once, with no wait for the garbage collector
(which the next model loaded would have measured the memory beside). `Runtime.close()` frees them
now, whoever still holds what; parts still held at the interpreter's exit are freed then. Either way
the engines still alive (held weakly here) are closed first, each after the step under way: an engine
thread still stepping at the interpreter's exit (a daemon thread) read freed KV pages and weights (a
segmentation fault).
"""
from __future__ import annotations

import weakref

from treeserve.engine.kv_space import KVSpace
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.loaded_model import LoadedModel
from treeserve.runtime.telemetry import TelemetryTrace


class RuntimeParts:
    def __init__(self, executor=None):
        self.held = _Held(executor)
        # (the finalizer holds what is freed, not these parts: they go by reference counting)
        self.free = weakref.finalize(self, self.held.free)

    def add_engine(self, engine: LLMEngine) -> None:
        """An engine running on these parts, closed before they are freed while it lives."""
        self.held.engines.append(weakref.ref(engine))

    @property
    def spaces(self) -> list[KVSpace]:
        return self.held.spaces

    @property
    def loaded(self) -> list[LoadedModel]:
        return self.held.loaded


class _Held:
    def __init__(self, executor):
        self.executor = executor  # the tensor-parallel workers it started (None: none)
        self.trace: TelemetryTrace | None = None
        self.spaces: list[KVSpace] = []  # the KV spaces it made
        self.loaded: list[LoadedModel] = []  # the models it loaded (those given loaded are their caller's)
        self.engines: list[weakref.ref] = []  # the engines running on them (none alive when the last one went)

    def free(self) -> None:
        """The engines still alive closed (each waits for a step under way), then what they ran on freed."""
        if self.trace:
            self.trace.close()
        engines = [engine for ref in self.engines if (engine := ref()) is not None]
        for engine in engines:
            engine.close()
        _when_closed(engines, self._free_memory)

    def _free_memory(self) -> None:
        for space in self.spaces:
            space.release()
        for model in self.loaded:
            model.release_weights()
        if self.executor is not None:
            self.executor.shutdown()


def _when_closed(engines: list[LLMEngine], fn) -> None:
    """`fn` once every engine's `close` has run."""
    if not engines:
        fn()
    else:
        engines[0].after_close(lambda: _when_closed(engines[1:], fn))
