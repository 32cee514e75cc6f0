"""Per-request block tables on top of the block pool: prefix lookup, allocation, fork, free.

With a sliding window on every layer (`window`), a block whose tokens are all behind the window of
the request's next token is read by no layer again: it goes back to the pool at once (still
findable by its hash until evicted, so a later request with that prefix can take it) and its
place in the table holds None, which the attention metadata sees as `NULL_BLOCK_ID` (a page
never read: every kernel starts at the window, and the gathering paths mask it out)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from treeserve.engine.block_pool import BlockPool, KVBlock
from treeserve.engine.request import Request

NULL_BLOCK_ID = 0  # stands for a freed block behind the window: any page, never written, never attended


@dataclass
class CachedPrefix:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    thrash_hashes: list[bytes] = field(default_factory=list)


_NO_PREFIX = CachedPrefix()  # (read only: what a running request's allocation counts as its prefix)


class KVCacheManager:
    """One model's view of a block pool; several managers (models) may share one pool."""

    def __init__(self, num_blocks: int | None = None, block_size: int = 16, enable_caching: bool = True,
                 pool: BlockPool | None = None, owner: str = "", window: int | None = None):
        self.block_size = block_size
        self.window = window
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching)
        self.owner = owner
        self.pool.add_owner(owner)
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}
        self._num_dropped: dict[str, int] = {}  # leading table entries freed behind the window
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for copy-on-write
        self._ids: dict[str, list[int]] = {}  # block_ids' answers, dropped whenever a table changes

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request, with_thrash: bool = True) -> CachedPrefix:
        """Longest run of cached full blocks, short of the positions whose logits are wanted. With
        `with_thrash`, also the hashes past it that were evicted lately (what taking the prefix
        counts as thrash); a caller that only looks (ranking the queue) leaves them out: with
        small blocks, a long prompt's misses are many."""
        if not self.pool.enable_caching:
            return CachedPrefix()
        max_blocks = request.max_cached_blocks(self.block_size)
        hashes = request.ensure_block_hashes(max_blocks, self.block_size)
        blocks = self.pool.lookup_run(itertools.islice(hashes, max_blocks))
        thrash = self.pool.thrash_window.among(hashes[len(blocks):max_blocks]) if with_thrash else []
        return CachedPrefix(blocks, len(blocks) * self.block_size, thrash)

    def can_allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        return self._shortfall(request, num_new_tokens, prefix) <= 0

    def fits_without_wanted(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """True when the slots can be had without evicting a prefix that waiting requests will hit."""
        return self._shortfall(request, num_new_tokens, prefix, spare_wanted=True) <= 0

    def _shortfall(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None,
                   spare_wanted: bool = False) -> int:
        table = self.block_tables.get(request.request_id, [])
        prefix = prefix or _NO_PREFIX
        computed = request.num_computed_tokens + prefix.num_tokens
        new_blocks = self._blocks_for(computed + num_new_tokens) - len(table) - len(prefix.blocks)
        cow = 1 if self._shared_tail_index(table, computed) is not None else 0
        # the prefix's own free blocks are taken, not allocated; sparing wanted blocks, the wanted ones
        # among them were never counted as available
        free = self.pool.num_free_before_wanted(self.owner) if spare_wanted else self.pool.num_free
        reusable_free = sum(1 for b in prefix.blocks if b.ref_count == 0 and not (spare_wanted and b.wanted_by))
        return max(new_blocks, 0) + cow - (free - reusable_free)

    def _shared_tail_index(self, table: list[KVBlock], num_computed: int) -> int | None:
        """Index of a partly filled block that other requests share, which the next token would write."""
        index = num_computed // self.block_size
        if num_computed % self.block_size and index < len(table) and table[index].ref_count > 1:
            return index
        return None

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Reserves KV slots for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        table = self.block_tables.get(request.request_id)
        if prefix is None and table and self._fits_in_table(request, table, num_new_tokens):
            if self.window is not None:  # a decode within its last block: nothing to allocate
                self.free_behind_window(request)
            return True
        if self._shortfall(request, num_new_tokens, prefix) > 0:
            return False
        self._ids.pop(request.request_id, None)
        table = self.block_tables.setdefault(request.request_id, [])
        if prefix is not None:
            self._take_prefix(request, table, prefix)
        tail = self._shared_tail_index(table, request.num_computed_tokens)
        if tail is not None:
            self._copy_on_write(table, tail)
        needed = self._blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > 0:
            table.extend(self.pool.allocate(needed, self.owner))
        self.free_behind_window(request)
        return True

    def _fits_in_table(self, request: Request, table: list[KVBlock], num_new_tokens: int) -> bool:
        """The slots lie in the table's blocks, and none of them is a tail shared with another
        request (`_shared_tail_index` is None; spelt out here: every decode of every step asks)."""
        computed = request.num_computed_tokens
        if computed + num_new_tokens > len(table) * self.block_size:
            return False
        index, offset = divmod(computed, self.block_size)
        return not offset or index >= len(table) or table[index].ref_count <= 1

    def free_behind_window(self, request: Request) -> None:
        """Frees the request's blocks that no layer reads again: the next query, at position
        num_computed_tokens, sees keys from num_computed_tokens - window + 1 on. Call after its
        full blocks were cached."""
        if self.window is None:  # (first: this runs for every request at every step)
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        first_key = max(request.num_computed_tokens - self.window + 1, 0)
        cached = self._num_hashed.get(request.request_id, 0) if self.pool.enable_caching else len(table)
        dead = min(first_key // self.block_size, cached)  # (cached first: a freed block stays findable)
        start = self._num_dropped.get(request.request_id, 0)
        if dead <= start:
            return
        blocks = [b for b in table[start:dead] if b is not None]
        table[start:dead] = [None] * (dead - start)
        self._ids.pop(request.request_id, None)
        self._num_dropped[request.request_id] = dead
        self.pool.free(reversed(blocks))

    def live_blocks(self, request_id: str) -> list[KVBlock]:
        """The request's blocks it still holds (not those freed behind the window)."""
        return [b for b in self.block_tables.get(request_id, ()) if b is not None]

    def _take_prefix(self, request: Request, table: list[KVBlock], prefix: CachedPrefix) -> None:
        self.pool.touch(prefix.blocks)
        table.extend(prefix.blocks)
        request.num_computed_tokens += prefix.num_tokens
        self._num_hashed[request.request_id] = len(table)
        # vLLM's counters take a request's first lookup only: a preempted one's recompute is not a query
        first = request.num_preemptions == 0
        self.pool.record_lookup(self.owner, request.num_tokens if first else 0, prefix.num_tokens if first else 0,
                                prefix.thrash_hashes)

    def record_reused(self, queried: int, reused: int) -> None:
        """Prompt tokens a request got without a prefix lookup (a fork of computed KV), counted as a
        lookup that found them: hits / queries stays the share of prompt tokens not recomputed."""
        self.pool.record_lookup(self.owner, queried, reused, [])

    def _copy_on_write(self, table: list[KVBlock], index: int) -> None:
        shared = table[index]
        (private,) = self.pool.allocate(1, self.owner)
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.free([shared])
        table[index] = private

    def cache_full_blocks(self, request: Request) -> None:
        """Makes blocks that became full (all tokens computed) findable by later requests."""
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_hashed.get(request.request_id, 0)
        if num_full <= done or not self.pool.enable_caching:
            return
        table = self.block_tables[request.request_id]
        hashes = request.ensure_block_hashes(num_full, self.block_size)
        for index in range(done, num_full):
            self.pool.cache_block(table[index], hashes[index])
        self._num_hashed[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Returns the blocks past the request's known tokens (slots of rejected draft tokens)."""
        table = self.block_tables.get(request.request_id)
        keep = self._blocks_for(request.num_tokens)
        if not table or len(table) <= keep:
            return
        spare = [b for b in table[keep:] if b is not None]
        del table[keep:]
        self._ids.pop(request.request_id, None)
        self.pool.free(reversed(spare))

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (copy-on-write for a partly filled tail)."""
        table = list(self.block_tables[parent.request_id])
        self.pool.share([b for b in table if b is not None])
        self.block_tables[child.request_id] = table
        self._ids.pop(child.request_id, None)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)
        self._num_dropped[child.request_id] = self._num_dropped.get(parent.request_id, 0)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        self._ids.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        self._num_dropped.pop(request.request_id, None)
        self.pool.free(reversed([b for b in table if b is not None]))

    def free_all(self) -> None:
        """Every table's blocks back to the pool, which forgets what this owner's waiting requests
        wanted or waited for: its engine was let go of while the pool, shared, serves on
        (runtime/runtime.py)."""
        for table in self.block_tables.values():
            self.pool.free(reversed([b for b in table if b is not None]))
        self.block_tables.clear()
        self._ids.clear()
        self._num_hashed.clear()
        self._num_dropped.clear()
        self.pool.set_wanted(self.owner, [])
        self.pool.stalled_owners.discard(self.owner)  # (the others would admit nothing new, waiting for it)

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table as ids (NULL_BLOCK_ID behind a window). The same list object is
        returned until the table changes, so a caller can tell "unchanged" by identity; never mutate it."""
        ids = self._ids.get(request.request_id)
        if ids is None:
            ids = [NULL_BLOCK_ID if b is None else b.block_id for b in self.block_tables[request.request_id]]
            self._ids[request.request_id] = ids
        return ids

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def stats(self):
        """This model's prefix-cache counters (the pool's own when it is not shared)."""
        return self.pool.owner_stats(self.owner)

    def num_blocks_in_use(self) -> int:
        """Blocks held by this model's requests."""
        return self.pool.num_in_use_by(self.owner)
