"""Which free KV block gives up its cached contents next, and the memory of what was given up.

Free blocks wait in one of four places:
  - empty: they hold no findable prefix, so taking them costs nothing; taken first.
  - probation, one LRU queue per model: cached blocks that only one request ever held (a candidate
    step no one chose, a decode tail). Search reuses a prefix in the very next step or never, so a
    block that nobody shared yet is the likeliest to be dead.
  - protected, one LRU queue per model: cached blocks that a second request took (a prefix-cache
    hit or a fork): the shared stem of a search tree, which the next step extends.
  - wanted, one LRU queue per model: cached blocks that a waiting request's prefix lookup found
    (`BlockPool.set_wanted`, each scheduling pass). Their reuse is the nearest of all: the queue
    is about to extend them.
Victims come from probation first (least recently freed across models). Then, by model:
  1. the model whose footprint (blocks in use + cached) most exceeds its fair share of the pool (an
     equal split) gives up its protected, then its wanted blocks;
  2. the requester gives up its own protected blocks;
  3. another model gives up protected blocks while its footprint is above FLOOR of its share:
     prefixes it reuses at its next turn go before the prefixes queued work reuses now;
  4. the requester gives up its own wanted blocks;
  5. nothing else is left: the oldest shared block of any model.
So one model's burst of new blocks (a verifier scoring many candidates) cannot sweep another
model's shared prefixes below FLOOR of its share, an idle model's surplus still goes to the busy
one, and what the queue is about to hit goes last.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict

from treeserve.engine.kv_block import KVBlock

# How many evicted block hashes the thrash detector remembers, per block in the pool.
THRASH_WINDOW_PER_BLOCK = 4
# The part of its fair share that a model's shared prefixes keep against another model's queued work.
FLOOR = 0.5


class ThrashWindow:
    """The most recently evicted block hashes, at most `capacity` (oldest forgotten first): a
    later request for one of them is thrash (evicted, then needed again). Each remembers the model
    whose allocation evicted it (in a shared arena: its own, or another model's)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity: the thrash window needs room for at least one hash, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, str] = OrderedDict()  # hash -> the evicting owner

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def among(self, block_hashes: list[bytes]) -> list[bytes]:
        """Those of `block_hashes` the window remembers, in their order."""
        remembered = self._hashes
        return [h for h in block_hashes if h in remembered]

    def add(self, block_hash: bytes, evicted_by: str = "") -> None:
        self._hashes[block_hash] = evicted_by
        self._hashes.move_to_end(block_hash)
        if len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def discard(self, block_hash: bytes) -> str | None:
        """Forgets a hash; the owner whose allocation evicted it (None if not remembered)."""
        return self._hashes.pop(block_hash, None)

    def clear(self) -> None:
        self._hashes.clear()


class FreeBlocks:
    """Blocks with no reference, by eviction tier and owner; `pop` picks the next victim."""

    def __init__(self, blocks: list[KVBlock]):
        self.num_blocks = len(blocks)
        self.empty: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)
        self.probation: dict[str, OrderedDict[int, KVBlock]] = {}
        self.protected: dict[str, OrderedDict[int, KVBlock]] = {}
        self.wanted: dict[str, OrderedDict[int, KVBlock]] = {}
        self._clock = itertools.count()
        self._size = len(blocks)

    def __len__(self) -> int:
        return self._size

    def num_before_wanted(self, requester: str, in_use: dict[str, int]) -> int:
        """How many blocks an allocation by `requester` surely takes before the first block that a
        waiting request will hit (steps 1-3; an over-share model's wanted blocks are not counted)."""
        count = len(self.empty) + sum(len(q) for q in self.probation.values())
        share = self.num_blocks / max(len(in_use), 1)
        for owner, queue in self.protected.items():
            if owner == requester:
                count += len(queue)
            else:
                count += min(len(queue), max(0, int(self._excess(owner, in_use) + share * (1 - FLOOR))))
        return count

    def num_cached(self, owner: str | None = None) -> int:
        """Free blocks still findable by hash (of one owner, or all)."""
        queues = [q for tier in (self.probation, self.protected, self.wanted) for o, q in tier.items()
                  if owner is None or o == owner]
        return sum(len(q) for q in queues)

    def push(self, block: KVBlock) -> None:
        """A block's last reference was dropped."""
        block.freed_at = next(self._clock)
        self._queue_of(block)[block.block_id] = block
        self._size += 1

    def remove(self, block: KVBlock) -> None:
        """A free block taken back as it is (a prefix-cache hit)."""
        del self._queue_of(block)[block.block_id]
        self._size -= 1

    def pop(self, requester: str, in_use: dict[str, int]) -> KVBlock:
        """The next victim for an allocation by `requester`; `in_use` counts referenced blocks by owner."""
        self._size -= 1
        return self._victim_queue(requester, in_use).popitem(last=False)[1]

    def pop_unshared(self, count: int) -> list[KVBlock]:
        """`pop`'s next victims, at most `count`, while they are empty or on probation (none once the
        next is a shared prefix). Which of those goes next depends on neither the requester nor the
        blocks in use, and taking one changes no other queue, so each run is taken in one go: the
        empty blocks, then from the probation queue with the oldest head as long as its head stays
        older than every other probation queue's (a tie goes back to `pop`'s choice)."""
        taken = _take(self.empty, count)
        while len(taken) < count:
            queue = self._oldest_head(self.probation.values())
            if queue is None:
                break
            taken += _take(queue, _run_older_than(queue, count - len(taken), self._other_heads_oldest(queue)))
        self._size -= len(taken)
        return taken

    def _other_heads_oldest(self, queue: OrderedDict[int, KVBlock]) -> float:
        """The oldest `freed_at` at the head of a probation queue other than `queue` (inf if none)."""
        heads = [next(iter(q.values())).freed_at for q in self.probation.values() if q and q is not queue]
        return min(heads, default=math.inf)

    def want(self, block: KVBlock, owner: str) -> None:
        """Queued work of `owner` will hit this block: if free, it moves to the wanted tier."""
        self._retier(block, owner)

    def unwant(self, block: KVBlock, owner: str) -> None:
        """No waiting request of `owner` wants the block now; a free one goes back to its tier as
        the most recently used (being wanted was a use)."""
        if block.wanted_by == owner:
            self._retier(block, None)

    def _retier(self, block: KVBlock, wanted_by: str | None) -> None:
        free = self._holds(block)
        if free:
            del self._queue_of(block)[block.block_id]
        block.wanted_by = wanted_by
        if free:
            block.freed_at = next(self._clock)
            self._queue_of(block)[block.block_id] = block

    def _holds(self, block: KVBlock) -> bool:
        return block.ref_count == 0 and block.block_id in self._queue_of(block)

    def next_is_shared(self) -> bool:
        """True when no empty or probation block is left: the next victim is a shared prefix."""
        return bool(self._size) and not self.empty and not any(self.probation.values())

    def _victim_queue(self, requester: str, in_use: dict[str, int]) -> OrderedDict[int, KVBlock]:
        if self.empty:
            return self.empty
        probation = self._oldest_head(self.probation.values())
        if probation is not None:
            return probation
        return self._shared_victim_queue(requester, in_use)

    def forget_hashes(self) -> None:
        """Every cached free block becomes empty (the prefix cache was reset)."""
        for tier in (self.probation, self.protected, self.wanted):
            for queue in tier.values():
                for block in queue.values():
                    block.wanted_by = None
                self.empty.update(queue)
                queue.clear()

    def _queue_of(self, block: KVBlock) -> OrderedDict[int, KVBlock]:
        if block.block_hash is None:
            return self.empty
        if block.wanted_by is not None:
            return self.wanted.setdefault(block.owner, OrderedDict())
        tier = self.protected if block.reused else self.probation
        return tier.setdefault(block.owner, OrderedDict())

    def _shared_victim_queue(self, requester: str, in_use: dict[str, int]) -> OrderedDict[int, KVBlock]:
        """Steps 1-5 of the module's order (there is no empty or probation block left)."""
        holders = {owner for tier in (self.protected, self.wanted) for owner, q in tier.items() if q}
        excess = {o: self._excess(o, in_use) for o in holders if o != requester}
        over = [o for o, e in excess.items() if e > 0]
        if over:
            owner = max(over, key=excess.__getitem__)
            return self.protected.get(owner) or self.wanted[owner]
        if self.protected.get(requester):
            return self.protected[requester]
        share = self.num_blocks / max(len(in_use), 1)
        above_floor = [o for o, e in excess.items() if e > -share * (1 - FLOOR) and self.protected.get(o)]
        if above_floor:
            return self.protected[max(above_floor, key=excess.__getitem__)]
        if self.wanted.get(requester):
            return self.wanted[requester]
        return self._oldest_head([q for tier in (self.protected, self.wanted) for q in tier.values()])

    def _excess(self, owner: str, in_use: dict[str, int]) -> float:
        """Blocks the owner holds (in use or cached) beyond an equal share of the pool."""
        share = self.num_blocks / max(len(in_use), 1)
        return in_use.get(owner, 0) + self.num_cached(owner) - share

    @staticmethod
    def _oldest_head(queues) -> OrderedDict[int, KVBlock] | None:
        heads = [q for q in queues if q]
        return min(heads, key=lambda q: next(iter(q.values())).freed_at) if heads else None


def _take(queue: OrderedDict[int, KVBlock], count: int) -> list[KVBlock]:
    """The first `count` blocks of a free queue (all of them if it holds fewer), removed."""
    if count >= len(queue):
        taken = list(queue.values())
        queue.clear()
        return taken
    return [queue.popitem(last=False)[1] for _ in range(count)]


def _run_older_than(queue: OrderedDict[int, KVBlock], count: int, bound: float) -> int:
    """How many of the queue's first blocks `pop` takes in a row, at most `count`: the head (the
    oldest of all heads), then each next one freed before `bound`, the other queues' oldest head."""
    if bound == math.inf:
        return min(count, len(queue))
    run = 1
    for block in itertools.islice(queue.values(), 1, count):
        if block.freed_at >= bound:
            break
        run += 1
    return run
