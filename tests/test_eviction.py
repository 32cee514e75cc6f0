"""The shared arena's eviction policy (engine/eviction.py) and the bounded thrash detector."""
from treeserve.engine.block_pool import BlockPool
from treeserve.engine.eviction import ThrashWindow


def _cached(pool, owner, count, tag, shared=False):
    """`count` blocks of `owner` filled, hashed and freed (reused once first when `shared`)."""
    blocks = pool.allocate(count, owner)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([tag, i]) * 16)
    if shared:
        pool.touch(blocks)  # a second request hit them: the stem of a search tree
        pool.free(reversed(blocks))
    pool.free(reversed(blocks))
    return blocks


def _cached_ids(pool, owner):
    return {b.block_id for b in pool.blocks if b.owner == owner and b.block_hash is not None and b.ref_count == 0}


def test_empty_blocks_go_first_then_blocks_nobody_shared():
    pool = BlockPool(8)
    stem = _cached(pool, "gen", 2, 1, shared=True)
    dead = _cached(pool, "gen", 2, 2)
    taken = pool.allocate(6, "gen")  # 4 empty, then the 2 unshared ones
    assert {b.block_id for b in taken} == {b.block_id for b in pool.blocks} - {b.block_id for b in stem}
    assert all(b.block_hash is not None for b in stem) and not any(b in taken for b in stem)
    assert pool.stats.evictions == len(dead)


def test_a_verifier_burst_cannot_sweep_the_generators_shared_prefixes():
    pool = BlockPool(12)
    pool.add_owner("gen"), pool.add_owner("prm")
    stem = _cached(pool, "gen", 3, 1, shared=True)  # within gen's fair share (6 of 12)
    _cached(pool, "prm", 4, 2, shared=True)
    burst = pool.allocate(9, "prm")  # everything but gen's stem
    assert {b.block_id for b in stem} == _cached_ids(pool, "gen")
    pool.free(burst)
    assert len(pool.allocate(12, "prm")) == 12  # with nothing else left, the stem goes too


def test_a_model_over_its_share_gives_up_its_shared_prefixes_first():
    pool = BlockPool(8)
    pool.add_owner("gen"), pool.add_owner("prm")
    _cached(pool, "gen", 2, 1, shared=True)
    big = _cached(pool, "prm", 6, 2, shared=True)  # prm holds 6 of 8: over its share of 4
    pool.allocate(2, "gen")  # nothing is empty: the model past its share (prm) gives up its oldest
    assert len(_cached_ids(pool, "gen")) == 2
    assert len(_cached_ids(pool, "prm")) == len(big) - 2


def test_the_thrash_window_is_bounded_and_remembers_the_recent():
    window = ThrashWindow(100)
    for i in range(10_000):
        window.add(i.to_bytes(4, "big"))
    assert len(window) == 100
    assert (9_999).to_bytes(4, "big") in window and (0).to_bytes(4, "big") not in window


def test_the_pools_thrash_detector_stays_bounded_under_a_long_stream_of_evictions():
    pool = BlockPool(4)
    for round_ in range(500):
        _cached(pool, "gen", 4, round_ % 256)
        pool.free(pool.allocate(4, "gen"))  # evicts the 4 just cached
    assert pool.stats.evictions >= 1_900
    assert pool.thrash_window_size <= pool.thrash_window.capacity
    assert pool.was_evicted(bytes([499 % 256, 3]) * 16)  # the latest evictions are remembered
