"""A byte-bounded LRU map from a step key to the PRM's score for it.

A key is a tuple of strings: the question, then the steps of one partial solution in order, so
`(question, step 1, ..., step k)` names the score of step k given everything before it. A long
search or a long-lived server sees an unbounded stream of such keys; the cache keeps the most
recently used ones within `max_bytes` and evicts the least recently used first.

Sizes are estimates, not measurements: an entry costs the UTF-8 length of its strings plus
`ENTRY_OVERHEAD_BYTES`. Strings shared between keys (the question, common step prefixes) are
counted once per entry, so the estimate errs on the large side, which is the safe side for a bound.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

DEFAULT_MAX_BYTES = 64 << 20
# What one entry costs CPython beyond its characters: the dict slot and the ordered-dict link
# (about 100 bytes), the key tuple (56 bytes plus 8 per string), the float (24 bytes) and the
# headers of a few str objects (49 bytes each). Rounded up so a typical 3-6 step key is covered.
ENTRY_OVERHEAD_BYTES = 256

StepKey = tuple[str, ...]
_MISSING = object()


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8; ASCII text (the common case) needs no encoding pass."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def entry_bytes(key: StepKey) -> int:
    """The estimated size of one entry: its strings' UTF-8 bytes plus the fixed overhead."""
    if not isinstance(key, tuple):
        raise TypeError(f"score cache key: expected a tuple of strings, got {type(key).__name__}")
    total = ENTRY_OVERHEAD_BYTES
    for part in key:
        if not isinstance(part, str):
            raise TypeError(f"score cache key: every part must be a str, got {type(part).__name__}")
        total += utf8_length(part)
    return total


def validate_max_bytes(max_bytes) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise ValueError(f"score_cache_bytes: must be a positive integer, got {max_bytes!r}")
    if max_bytes <= 0:
        raise ValueError(f"score_cache_bytes: must be > 0, got {max_bytes}")
    return max_bytes


class ScoreCache:
    """LRU map `step key -> score` bounded by estimated bytes; every operation is O(1) in entries.

    Reading a score (`cache[key]`, a `get` that hits) makes its entry the most recent; `key in
    cache` does not. Writing an existing key replaces its score and makes it the most recent. An
    entry larger than the whole bound is not kept at all (and counted in `num_rejected`), rather
    than flushing every other entry to make room for it.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = validate_max_bytes(max_bytes)
        self.nbytes = 0
        self.num_evictions = 0
        self.num_rejected = 0
        self._entries: OrderedDict[StepKey, tuple[float, int]] = OrderedDict()  # key -> (score, size)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __getitem__(self, key: StepKey) -> float:
        score, _ = self._entries[key]
        self._entries.move_to_end(key)
        return score

    def get(self, key: StepKey, default=None):
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            return default
        self._entries.move_to_end(key)
        return entry[0]

    def __setitem__(self, key: StepKey, score: float) -> None:
        size = entry_bytes(key)  # first: it also rejects a malformed key with a clear message
        if key in self._entries:
            self._entries[key] = (score, size)
            self._entries.move_to_end(key)
            return
        if size > self.max_bytes:
            self.num_rejected += 1
            return
        self._entries[key] = (score, size)
        self.nbytes += size
        self._evict_to_fit()

    def update(self, items: Iterable[tuple[StepKey, float]]) -> None:
        for key, score in items:
            self[key] = score

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _evict_to_fit(self) -> None:
        while self.nbytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.nbytes -= size
            self.num_evictions += 1

    def __repr__(self) -> str:
        return (f"ScoreCache({len(self)} entries, {self.nbytes}/{self.max_bytes} bytes, "
                f"{self.num_evictions} evicted)")
