"""Callbacks that do not keep their object alive.

An engine's parts call back into it (its scheduler frees kept KV through the engine's `reclaim_one`).
Held strongly, such a callback is a reference cycle (engine -> scheduler -> bound method -> engine):
the engine, its KV views and whatever it keeps alive (a Runtime's arena, tensor-parallel workers)
then wait for the garbage collector instead of going with the last reference, as the engine's
callers expect of `del`."""
from __future__ import annotations

import weakref
from typing import Callable


def weakly(method, default=False) -> Callable:
    """`method` (a bound method) called while its object lives; `default` once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        alive = ref()
        return default if alive is None else alive(*args, **kwargs)
    return call
