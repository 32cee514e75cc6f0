"""Fixed pool of KV blocks: reference counts, prefix-cache hash table, LRU free queue.

A free block may still hold a cached prefix: it stays findable by hash until it is evicted,
which happens only when it is taken from the head of the free queue for new data. Requests free
their blocks tail-first, so a request's tail blocks are evicted before its head.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from treeserve.errors import ParamError


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    owner: str = ""  # which model's data the block holds (a pool can be shared by several models)


@dataclass
class PrefixCacheStats:
    queries: int = 0        # prompt tokens looked up
    hits: int = 0           # of which found in the cache
    evictions: int = 0      # cached blocks whose contents were dropped for new data
    thrash: int = 0         # evicted block hashes that were requested again later

    def snapshot(self) -> "PrefixCacheStats":
        return PrefixCacheStats(self.queries, self.hits, self.evictions, self.thrash)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ParamError("num_blocks", f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.evicted_hashes: set[bytes] = set()
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()  # all owners together
        self.stats_by_owner: dict[str, PrefixCacheStats] = {}
        self.in_use_by_owner: dict[str, int] = {}  # blocks with ref_count > 0, by owner

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        """Free blocks whose contents are still findable by hash."""
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def was_evicted(self, block_hash: bytes) -> bool:
        return block_hash in self.evicted_hashes

    def owner_stats(self, owner: str) -> PrefixCacheStats:
        return self.stats_by_owner.setdefault(owner, PrefixCacheStats())

    def record_lookup(self, owner: str, queried: int, hit: int, thrash_hashes: list[bytes]) -> None:
        for h in thrash_hashes:
            self.evicted_hashes.discard(h)
        for stats in (self.stats, self.owner_stats(owner)):
            stats.queries += queried
            stats.hits += hit
            stats.thrash += len(thrash_hashes)

    def num_in_use_by(self, owner: str) -> int:
        return self.in_use_by_owner.get(owner, 0)

    def _count_in_use(self, block: KVBlock, delta: int) -> None:
        self.in_use_by_owner[block.owner] = self.in_use_by_owner.get(block.owner, 0) + delta

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
                self._count_in_use(block, 1)
            block.ref_count += 1

    def allocate(self, count: int, owner: str = "") -> list[KVBlock]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            block.owner = owner
            self._count_in_use(block, 1)
            taken.append(block)
        return taken

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self.evicted_hashes.add(block.block_hash)
            self.stats.evictions += 1
            self.owner_stats(block.owner).evictions += 1
        block.block_hash = None

    def free(self, blocks_tail_first) -> None:
        for block in blocks_tail_first:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                self._count_in_use(block, -1)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Registers a block that just became full; a duplicate of a cached hash stays private."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_count for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
