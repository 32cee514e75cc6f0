"""`BlockPool.allocate` takes empty and probation blocks in runs (`FreeBlocks.pop_unshared`): the
same victims in the same order, evictions, thrash records, stats and reclaim calls as taking them
one `FreeBlocks.pop` at a time, which `PerBlockPool` below keeps (the allocation before the runs)."""
import random

import pytest

from treeserve.engine.block_pool import BlockPool
from treeserve.engine.eviction import FreeBlocks

OWNERS = ("gen", "prm", "draft")


class PerBlockPool(BlockPool):
    """The reference: one victim at a time, a reclaim tried before each shared one."""

    def allocate(self, count, owner=""):
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        taken = []
        for _ in range(count):
            while self.free_blocks.next_is_shared() and self.reclaim(owner):
                pass
            block = self.free_blocks.pop(owner, self.in_use_by_owner)
            block.wanted_by = None
            if block.block_hash is not None:  # (the eviction, as `_evict` was)
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    self.thrash_window.add(block.block_hash, owner)
                    self.stats.evictions += 1
                    self.owner_stats(block.owner).evictions += 1
                block.block_hash = None
            block.ref_count = 1
            block.owner = owner
            block.reused = False
            self._count_in_use(block, 1)
            taken.append(block)
        return taken


class Model:
    """One pool and the sequences its callers hold (by block id), with a reclaim callback that
    releases a kept sequence, the asking owner's oldest first, and logs every call."""

    def __init__(self, pool_class, num_blocks):
        self.pool = pool_class(num_blocks, reclaim=self._reclaim)
        self.live: list[tuple[str, list]] = []  # (owner, blocks)
        self.kept: list[tuple[str, list]] = []
        self.calls: list[tuple[str, bool]] = []

    def _reclaim(self, owner):
        order = [i for i, (o, _) in enumerate(self.kept) if o == owner] + \
                [i for i, (o, _) in enumerate(self.kept) if o != owner]
        if order:
            _, blocks = self.kept.pop(order[0])
            self.pool.free(reversed(blocks))
        self.calls.append((owner, bool(order)))
        return bool(order)

    def state(self):
        pool, free = self.pool, self.pool.free_blocks
        tiers = {name: {o: list(q) for o, q in getattr(free, name).items()} for name in ("probation", "protected", "wanted")}
        blocks = [(b.ref_count, b.block_hash, b.owner, b.reused, b.freed_at, b.wanted_by) for b in pool.blocks]
        return (list(free.empty), tiers, len(free), blocks, {h: b.block_id for h, b in pool.cached.items()},
                list(pool.thrash_window._hashes.items()), pool.stats, list(pool.stats_by_owner.items()), list(pool.in_use_by_owner.items()),
                {o: [b.block_id for b in bs] for o, bs in pool.wanted_by_owner.items()}, list(self.calls),
                [(o, [b.block_id for b in bs]) for o, bs in self.live], [(o, [b.block_id for b in bs]) for o, bs in self.kept])


def _hash(rng):
    return rng.randrange(48).to_bytes(2, "big") * 8  # a small space: duplicates, hits and thrash


OPS = ("allocate", "cache", "free", "keep", "touch", "share", "want", "lookup", "reset")
WEIGHTS = (8, 6, 5, 2, 3, 2, 3, 2, 0.2)


def _step(models, rng, ops=OPS, weights=WEIGHTS):
    """One random operation, the same on every model (blocks named by id)."""
    pool0, live0 = models[0].pool, models[0].live
    op = rng.choices(ops, weights=weights)[0]
    owner = rng.choice(OWNERS)
    if op == "allocate" and pool0.num_free:
        count = rng.randint(1, min(pool0.num_free, rng.choice((2, 8, 40))))
        for m in models:
            m.live.append((owner, m.pool.allocate(count, owner)))
    elif op == "cache" and live0:
        index = rng.randrange(len(live0))
        picks = [(i, _hash(rng)) for i in range(len(live0[index][1])) if rng.random() < 0.7]
        for m in models:
            for i, h in picks:
                m.pool.cache_block(m.live[index][1][i], h)
    elif op in ("free", "keep") and live0:
        index = rng.randrange(len(live0))
        for m in models:
            seq = m.live.pop(index)
            if op == "keep":
                m.kept.append(seq)
            else:
                m.pool.free(reversed(seq[1]))
    elif op == "touch":
        hashes = [_hash(rng) for _ in range(rng.randint(1, 6))]
        for m in models:
            found = [b for b in map(m.pool.lookup, hashes) if b is not None and b.owner == owner]
            m.pool.touch(found)
            m.live.append((owner, found))
    elif op == "share" and live0:
        index = rng.randrange(len(live0))
        for m in models:
            m.pool.share(m.live[index][1])
            m.live.append(m.live[index])
    elif op == "want":
        hashes = [_hash(rng) for _ in range(rng.randint(0, 10))]
        for m in models:
            m.pool.set_wanted(owner, [b for b in map(m.pool.lookup, hashes) if b is not None])
    elif op == "lookup":
        hashes = [_hash(rng) for _ in range(rng.randint(1, 6))]
        for m in models:
            m.pool.record_lookup(owner, len(hashes), 0, m.pool.thrash_window.among(hashes))
    elif op == "reset":
        for m in models:
            m.pool.reset_prefix_cache()
    elif op == "drop_head" and live0:  # a sliding window frees a sequence's first blocks, head first
        index = rng.randrange(len(live0))
        drop = rng.randint(0, len(live0[index][1]))
        for m in models:
            owner, blocks = m.live[index]
            m.live[index] = (owner, blocks[drop:])
            m.pool.free(blocks[:drop])


@pytest.mark.parametrize("seed", range(40))
def test_allocating_in_runs_decides_as_one_block_at_a_time(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice((16, 48, 128))
    models = [Model(PerBlockPool, num_blocks), Model(BlockPool, num_blocks)]
    for owner in OWNERS[:rng.randint(1, 3)]:
        for m in models:
            m.pool.add_owner(owner)
    for _ in range(600):
        _step(models, rng)
        assert models[1].state() == models[0].state()
    assert models[1].pool.stats.evictions > 0


@pytest.mark.parametrize("num_blocks", (1, 2, 3, 5, 9))
def test_runs_decide_as_one_block_at_a_time_in_tiny_pools_with_window_frees(num_blocks):
    """Pools of a few blocks (a run is the whole pool, or a single block) and frees head first, as a
    sliding window drops a sequence's first blocks (free order across the probation queues interleaves)."""
    ops, weights = OPS + ("drop_head",), WEIGHTS[:-1] + (1, 3)  # (a reset rarely: it needs an empty pool)
    evictions = 0
    for seed in range(12):
        rng = random.Random(seed)
        models = [Model(PerBlockPool, num_blocks), Model(BlockPool, num_blocks)]
        for owner in OWNERS[:1 + seed % 3]:
            for m in models:
                m.pool.add_owner(owner)
        for _ in range(300):
            _step(models, rng, ops, weights)
            assert models[1].state() == models[0].state()
        evictions += models[1].pool.stats.evictions
    assert evictions > 0


def test_a_run_of_empty_and_probation_blocks_is_taken_without_a_pop_each(monkeypatch):
    pool = BlockPool(64)
    for tag, owner in enumerate(("gen", "prm")):
        blocks = pool.allocate(16, owner)
        for i, block in enumerate(blocks):
            pool.cache_block(block, bytes([tag, i]) * 8)
        pool.free(reversed(blocks))
    pops = []
    monkeypatch.setattr(FreeBlocks, "pop", lambda self, *a: pops.append(a))
    assert len(pool.allocate(64, "gen")) == 64  # 32 empty, then both models' probation queues
    assert pops == [] and pool.stats.evictions == 32
