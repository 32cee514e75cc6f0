"""A step and `close` never overlap: a close from another thread waits for the step under way, and
one from the stepping thread itself (a finalizer that the garbage collector runs there mid-step: a
dropped `Runtime` whose engine thread still steps) runs when that step ends, not inside it, where it
would free the weights and KV pages the step is reading (a segmentation fault)."""
from __future__ import annotations

import threading
from typing import Callable


class CloseGuard:
    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0  # calls under way (on the thread holding the lock)
        self._deferred: list[Callable[[], None]] = []

    def __enter__(self) -> "CloseGuard":
        """Around what runs the model (`step`, `add_request`)."""
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        try:
            while self._depth == 0 and self._deferred:
                self._deferred.pop(0)()
        finally:
            self._lock.release()

    def run_or_defer(self, fn: Callable[[], None]) -> None:
        """Runs `fn` once no call is under way: now (after another thread's step), or, called from
        within one on this thread, as it ends (calls deferred run in order)."""
        with self._lock:
            if self._depth:
                self._deferred.append(fn)
            else:
                fn()
