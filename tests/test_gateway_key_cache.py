"""The gateway's key cache: a key read once for all the requests that ask for it at one moment
(no stampede on the database when a popular key's entry expires), kept for its TTL."""
from __future__ import annotations

import asyncio

from treeserve.gateway.key_cache import KeyCache
from treeserve.gateway.keys import KeyRecord

RECORD = KeyRecord(1, "sk-...abcd", "bench", None, None, None, None, None, None)


def test_concurrent_misses_read_the_database_once():
    async def main():
        cache, reads = KeyCache(ttl=0.2), []

        async def loader():
            reads.append(1)
            await asyncio.sleep(0.05)
            return RECORD
        waiters = [asyncio.ensure_future(cache.load("sk-token", loader)) for _ in range(32)]
        await asyncio.sleep(0.01)
        waiters[0].cancel()  # a client that leaves does not cancel the read the others wait on
        results = await asyncio.gather(*waiters[1:])
        assert results == [RECORD] * 31 and len(reads) == 1
        assert cache.get("sk-token") == RECORD
        await asyncio.sleep(0.25)  # expired: the next miss reads again
        assert cache.get("sk-token") is None
        assert await cache.load("sk-token", loader) == RECORD and len(reads) == 2

        async def unknown():
            return None
        assert await cache.load("sk-other", unknown) is None and cache.get("sk-other") is None
    asyncio.run(main())


def test_a_read_in_flight_when_the_cache_is_cleared_is_not_kept():
    """A key regenerated, blocked or deleted clears the cache; a read of the key that began before
    (and saw the old row) was put in the cache when it ended, and answered the requests that came
    after the change: the old secret kept working for the cache's TTL in this very process."""
    async def main():
        cache, reads, changed = KeyCache(ttl=60), [], asyncio.Event()

        async def before_the_change():
            reads.append("old")
            await changed.wait()
            return RECORD

        async def after_the_change():
            reads.append("new")
            return None  # (the old secret is gone)
        first = asyncio.ensure_future(cache.load("sk-old", before_the_change))
        await asyncio.sleep(0.01)
        cache.clear()  # the admin change has committed
        later = asyncio.ensure_future(cache.load("sk-old", after_the_change))
        changed.set()
        assert await first == RECORD  # (its request was let in before the change: as any request in flight)
        assert await later is None and reads == ["old", "new"]
        assert cache.get("sk-old") is None
    asyncio.run(main())
