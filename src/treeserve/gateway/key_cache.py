"""Keys this process checked recently: a request with a known key skips the database read (and
the thread hop it needs). Only valid keys are kept, for `ttl` seconds and at most `size` of them;
their budgets and limits are not cached (admission reads them live).

`clear` (after an admin change: a key blocked, deleted, regenerated) also forgets the reads in
flight: a read that began before the change may have seen the old row, so what it finds answers
only the requests that were waiting on it and is not kept, and a request after the change reads again."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from treeserve.gateway.keys import KeyRecord, hash_key


class KeyCache:
    def __init__(self, ttl: float, size: int = 10_000):
        self.ttl, self.size = ttl, size
        self._entries: OrderedDict[str, tuple[float, KeyRecord]] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        self._generation = 0  # how many times the cache was cleared

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

    async def load(self, token: str, loader: Callable[[], Awaitable[KeyRecord | None]]) -> KeyRecord | None:
        """The key's record from `loader` (the database), read once however many requests with this
        key ask at the same moment: when a popular key's entry expires, its concurrent requests
        wait on one read instead of each taking a thread and a pooled connection."""
        digest, generation = hash_key(token), self._generation
        task = self._loading.get(digest)  # (one begun since the last clear: a clear forgets the others)
        if task is None:
            task = asyncio.ensure_future(loader())
            self._loading[digest] = task
            task.add_done_callback(lambda done: self._forget(digest, done))
        record = await asyncio.shield(task)  # a request that leaves does not cancel the others' read
        if record is not None and generation == self._generation:  # (not read before a clear)
            self.put(token, record)
        return record

    def _forget(self, digest: str, task: asyncio.Future) -> None:
        if self._loading.get(digest) is task:  # (a clear may have let a newer read take its place)
            del self._loading[digest]

    def clear(self) -> None:
        self._entries.clear()
        self._loading.clear()
        self._generation += 1
