"""Keys this process checked recently: a request with a known key skips the database read (and
the thread hop it needs). Only valid keys are kept, for `ttl` seconds and at most `size` of them;
their budgets and limits are not cached (admission reads them live)."""
from __future__ import annotations

import time
from collections import OrderedDict

from treeserve.gateway.keys import hash_key
from treeserve.gateway.store import KeyRecord


class KeyCache:
    def __init__(self, ttl: float, size: int = 10_000):
        self.ttl, self.size = ttl, size
        self._entries: OrderedDict[str, tuple[float, KeyRecord]] = OrderedDict()

    def get(self, token: str) -> KeyRecord | None:
        if self.ttl <= 0:
            return None
        entry = self._entries.get(hash_key(token))
        if entry is None or time.monotonic() - entry[0] > self.ttl:
            return None
        return entry[1]

    def put(self, token: str, key: KeyRecord) -> None:
        if self.ttl <= 0:
            return
        digest = hash_key(token)
        self._entries[digest] = (time.monotonic(), key)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
