"""Fixed pool of KV blocks: reference counts, prefix-cache hash table, tiered free queues.

A free block may still hold a cached prefix: it stays findable by hash until it is evicted,
which happens only when it is taken for new data. Which free block goes first is
`eviction.FreeBlocks`' decision: empty blocks, then blocks that only one request ever held, then
shared prefixes, with each model's shared prefixes safe from other models within a fair share.
Requests free their blocks tail-first, so within a tier a request's tail is evicted before its head.
"""
from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable

from treeserve.engine.close_guard import CloseGuard
from treeserve.engine.eviction import THRASH_WINDOW_PER_BLOCK, FreeBlocks, ThrashWindow
from treeserve.engine.kv_block import KVBlock
from treeserve.errors import ParamError

_is_block = functools.partial(operator.is_not, None)  # (a lookup's answer is a block, not None)


@dataclass
class PrefixCacheStats:
    queries: int = 0        # prompt tokens looked up
    hits: int = 0           # of which found in the cache
    evictions: int = 0      # cached blocks whose contents were dropped for new data
    thrash: int = 0         # evicted block hashes that were requested again later
    # thrash by the model whose allocation evicted the block (a shared arena: the owner itself or another)
    thrash_by_evictor: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> "PrefixCacheStats":
        return PrefixCacheStats(self.queries, self.hits, self.evictions, self.thrash, dict(self.thrash_by_evictor))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reclaim: Callable[[str], bool] | None = None):
        if num_blocks < 1:
            raise ParamError("num_blocks", f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_blocks = FreeBlocks(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        # Recently evicted hashes (the thrash detector), bounded: a hash evicted longer ago than a few
        # pool turnovers is forgotten, so a request for it then counts as a plain miss.
        self.thrash_window = ThrashWindow(THRASH_WINDOW_PER_BLOCK * num_blocks)
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()  # all owners together
        self.stats_by_owner: dict[str, PrefixCacheStats] = {}
        self.in_use_by_owner: dict[str, int] = {}  # blocks with ref_count > 0, by owner
        self.wanted_by_owner: dict[str, list[KVBlock]] = {}  # cached blocks waiting requests will hit
        # Frees one sequence kept pinned for later forks, the requesting owner's first (False if none).
        # Tried before any shared prefix is evicted: a released sequence loses at most its partly
        # filled tail block, and its blocks nobody shared become the next victims instead.
        self.reclaim: Callable[[str], bool] = reclaim or (lambda owner: False)
        # Models sharing the pool whose waiting requests wait for blocks the others' requests hold
        # (set by the engine loop after each pass): the others admit nothing new until they get
        # them, so that the blocks those requests free go to the model that waits, not to new work.
        self.stalled_owners: set[str] = set()
        # What changes the pool runs under this, for every engine drawing from it (engine/close_guard.py)
        self.guard = CloseGuard()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def num_wanted_by(self, owner: str) -> int:
        """Cached blocks (free or in use) that the owner's waiting requests will hit."""
        return len(self.wanted_by_owner.get(owner, ()))

    def num_free_before_wanted(self, owner: str) -> int:
        """Free blocks an allocation by `owner` takes before evicting a prefix that a waiting
        request is about to reuse."""
        return self.free_blocks.num_before_wanted(owner, self.in_use_by_owner)

    @property
    def num_cached_free(self) -> int:
        """Free blocks whose contents are still findable by hash."""
        return self.free_blocks.num_cached()

    @property
    def thrash_window_size(self) -> int:
        """Evicted block hashes the thrash detector remembers now (at most `thrash_window.capacity`)."""
        return len(self.thrash_window)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def add_owner(self, owner: str) -> None:
        """Registers a model drawing from this pool (its fair share counts from now on)."""
        self.in_use_by_owner.setdefault(owner, 0)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def lookup_run(self, hashes: Iterable[bytes]) -> list[KVBlock]:
        """The cached blocks of `hashes`, up to the first one not cached (one `lookup` each, in C)."""
        if not self.enable_caching:
            return []
        return list(itertools.takewhile(_is_block, map(self.cached.get, hashes)))

    def was_evicted(self, block_hash: bytes) -> bool:
        return block_hash in self.thrash_window

    def owner_stats(self, owner: str) -> PrefixCacheStats:
        return self.stats_by_owner.setdefault(owner, PrefixCacheStats())

    def record_lookup(self, owner: str, queried: int, hit: int, thrash_hashes: list[bytes]) -> None:
        evictors = [self.thrash_window.discard(h) for h in thrash_hashes]
        for stats in (self.stats, self.owner_stats(owner)):
            stats.queries += queried
            stats.hits += hit
            stats.thrash += len(thrash_hashes)
            for evictor in evictors:
                if evictor is not None:
                    stats.thrash_by_evictor[evictor] = stats.thrash_by_evictor.get(evictor, 0) + 1

    def num_in_use_by(self, owner: str) -> int:
        return self.in_use_by_owner.get(owner, 0)

    def waits_for_blocks(self, other_than: str) -> bool:
        """Whether a model other than `other_than` waits for the blocks others hold (see stalled_owners)."""
        return any(owner != other_than for owner in self.stalled_owners)

    def num_in_use_by_others(self, owner: str) -> int:
        """Blocks that the other models sharing the pool hold (their requests free them as they end)."""
        return sum(count for other, count in self.in_use_by_owner.items() if other != owner)

    def _count_in_use(self, block: KVBlock, delta: int) -> None:
        self.in_use_by_owner[block.owner] = self.in_use_by_owner.get(block.owner, 0) + delta

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_blocks.remove(block)
                self._count_in_use(block, 1)
            block.ref_count += 1
            block.reused = True

    def share(self, blocks: list[KVBlock]) -> None:
        """Takes one more reference on blocks in use (a fork)."""
        for block in blocks:
            block.ref_count += 1
            block.reused = True

    def allocate(self, count: int, owner: str = "") -> list[KVBlock]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        taken: list[KVBlock] = []
        while len(taken) < count:
            while self.free_blocks.next_is_shared() and self.reclaim(owner):
                pass
            # empty and probation blocks in runs; a shared prefix one at a time (the fair shares it
            # is chosen by move with each block taken, and `reclaim` is tried before each)
            run = self.free_blocks.pop_unshared(count - len(taken)) or [self.free_blocks.pop(owner, self.in_use_by_owner)]
            self._take(run, owner)
            taken += run
        return taken

    def _take(self, blocks: list[KVBlock], owner: str) -> None:
        """Victims become `owner`'s new blocks; a cached one is evicted (its hash forgotten, and
        remembered by the thrash detector with `owner` as the evictor)."""
        cached, window = self.cached, self.thrash_window
        evicted: dict[str, int] = {}  # by the evicted block's owner, in first-evicted order
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None and cached.get(block_hash) is block:
                del cached[block_hash]
                window.add(block_hash, owner)
                evicted[block.owner] = evicted.get(block.owner, 0) + 1
            block.block_hash = None
            block.wanted_by = None
            block.ref_count = 1
            block.owner = owner
            block.reused = False
        for evicted_owner, count in evicted.items():
            self.stats.evictions += count
            self.owner_stats(evicted_owner).evictions += count
        self.in_use_by_owner[owner] = self.in_use_by_owner.get(owner, 0) + len(blocks)

    def set_wanted(self, owner: str, blocks: list[KVBlock]) -> None:
        """The cached blocks that `owner`'s waiting requests will hit (replacing the last set): free
        ones are evicted only when nothing else is left, so queued work finds its prefixes."""
        # (each block once, in first-seen order: requests sharing a prefix list its blocks many times,
        # and a block's second mention changes nothing)
        keep = dict.fromkeys(blocks)
        for block in dict.fromkeys(self.wanted_by_owner.get(owner, ())):
            if block not in keep:
                self.free_blocks.unwant(block, owner)
        for block in keep:
            if block.wanted_by != owner:
                self.free_blocks.want(block, owner)
        self.wanted_by_owner[owner] = list(blocks)

    def free(self, blocks_tail_first) -> None:
        for block in blocks_tail_first:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks.push(block)
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
        self.free_blocks.forget_hashes()
        self.wanted_by_owner.clear()
        self.cached.clear()
        self.thrash_window.clear()  # nothing cached before the reset counts as evicted
        return True
