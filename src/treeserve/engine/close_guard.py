"""A step and `close` never overlap: a close from another thread waits for the step under way, and
one from the stepping thread itself (a finalizer that the garbage collector runs there mid-step: a
dropped `Runtime` whose engine thread still steps) runs when that step ends, not inside it, where it
would free the weights and KV pages the step is reading (a segmentation fault).

The engines sharing one KV pool share one guard (`BlockPool.guard`): what changes the pool (a step,
an abort, a kept sequence released) runs under it, and an engine let go of gives its blocks back
through `run_when_free`, which never waits: its last reference may go on any thread, at any
allocation (the garbage collector), while another engine on the pool steps."""
from __future__ import annotations

import threading
from typing import Callable


class CloseGuard:
    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0  # calls under way (on the thread holding the lock)
        self._deferred: list[Callable[[], None]] = []

    def __enter__(self) -> "CloseGuard":
        """Around what runs the model or changes the KV pool (`step`, `add_request`, `abort_request`)."""
        self._lock.acquire()
        try:
            if self._depth == 0:  # (what `run_when_free` left as the last call ended)
                self._run_deferred()
        except BaseException:
            self._lock.release()
            raise
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        try:
            if self._depth == 0:
                self._run_deferred()
        finally:
            self._lock.release()

    def _run_deferred(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def run_or_defer(self, fn: Callable[[], None]) -> None:
        """Runs `fn` once no call is under way: now (after another thread's step), or, called from
        within one on this thread, as it ends (calls deferred run in order)."""
        with self._lock:
            if self._depth:
                self._deferred.append(fn)
            else:
                fn()

    def run_when_free(self, fn: Callable[[], None]) -> None:
        """Runs `fn` now if no call is under way on any thread, else as the call under way ends (or
        the next one starts), without waiting: for a finalizer, which must not block the thread the
        last reference went on (it may hold a lock the stepping thread needs)."""
        self._deferred.append(fn)  # (atomic: a call under way on another thread runs it as it ends)
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._depth == 0:
                self._run_deferred()
        finally:
            self._lock.release()
