"""Owners let go of whose memory waits for the garbage collector.

A `Runtime` let go of without `close()` frees its parts (runtime/parts.py: weights, KV arena,
tensor-parallel workers) once neither it nor any of its engines is referenced; they refer to one
another, so only the collector finds that, when it next runs a full collection. A model loaded
meanwhile (`LLM(...)`, a server's engine) would measure the memory left with the old weights and
arena still held, and start its workers beside the old ones ("this process already runs a
tensor-parallel engine"); `del rt` used to free all of that at once. So loading a model collects
first while such an owner is pending, as a new Runtime always does (vLLM collects before it profiles);
with none pending it costs nothing (a full collection takes ~0.2 s with PyTorch and transformers loaded).
"""
from __future__ import annotations

import gc
import weakref

_PENDING: weakref.WeakSet = weakref.WeakSet()  # owners let go of, until the collector frees them


def let_go(owner: weakref.ref) -> None:
    """The owner (anything with `closed`) was let go of: what it holds goes when the collector finds it.
    Given weakly (a finalizer's argument held strongly would keep it through the collection that finds
    it); None where that collection is this one."""
    alive = owner()
    if alive is not None:
        _PENDING.add(alive)


def collect_let_go() -> None:
    """A full collection where an owner let go of is still open (an engine of it may be held: then it stays)."""
    if any(not owner.closed for owner in list(_PENDING)):
        gc.collect()
