"""The shared arena's eviction policy (engine/eviction.py) and the bounded thrash detector."""
from treeserve.engine.block_pool import BlockPool
from treeserve.engine.eviction import FLOOR, ThrashWindow


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


def test_blocks_that_waiting_requests_want_are_evicted_last_and_return_to_their_tier():
    pool = BlockPool(6)
    pool.add_owner("prm")
    wanted = _cached(pool, "prm", 2, 1)   # the prefix of a queued request
    pool.set_wanted("prm", wanted)
    other = _cached(pool, "prm", 2, 2)    # freed later, so LRU alone would evict `wanted` first
    taken = pool.allocate(4, "prm")       # 2 empty, then `other`, never `wanted`
    assert {b.block_id for b in wanted} == _cached_ids(pool, "prm")
    assert not any(b in taken for b in wanted)
    pool.free(reversed(taken))
    pool.set_wanted("prm", [])            # the request ran or left: plain LRU again
    assert all(b.wanted_by is None for b in wanted)
    assert set(pool.allocate(6, "prm")) >= set(wanted)  # with nothing else left, they go too


def test_wanted_blocks_of_a_model_over_its_share_go_before_another_models_shared_prefixes():
    pool = BlockPool(8)
    pool.add_owner("gen"), pool.add_owner("prm")
    stem = _cached(pool, "gen", 2, 1, shared=True)  # within gen's share (4 of 8)
    queued = _cached(pool, "prm", 6, 2)
    pool.set_wanted("prm", queued)                  # prm holds 6: over its share
    pool.allocate(2, "prm")                          # prm's own wanted blocks give way, not gen's stem
    assert {b.block_id for b in stem} == _cached_ids(pool, "gen")
    assert len(_cached_ids(pool, "prm")) == 4


def test_a_wanted_block_in_use_is_queued_as_wanted_when_freed():
    pool = BlockPool(4)
    held = _cached(pool, "prm", 2, 1)
    pool.touch(held)                     # a running request holds them
    pool.set_wanted("prm", held)         # and a waiting one will hit them
    pool.free(reversed(held))            # freed first: plain LRU would take them next
    later = _cached(pool, "prm", 2, 2, shared=True)  # the same tier, freed later
    taken = pool.allocate(2, "prm")
    assert {b.block_id for b in taken} == {b.block_id for b in later}


def test_queued_work_takes_another_models_shared_prefixes_down_to_its_floor_only():
    pool = BlockPool(16)
    pool.add_owner("gen"), pool.add_owner("prm")
    _cached(pool, "gen", 7, 1, shared=True)       # gen: 7 of its share of 8
    queued = _cached(pool, "prm", 9, 2)           # prm's prefixes that waiting requests will hit
    pool.set_wanted("prm", queued)
    floor = int(8 * FLOOR)
    assert pool.num_free_before_wanted("prm") == 7 - floor
    pool.allocate(7 - floor, "prm")               # gen's stem gives way first, down to its floor
    assert len(_cached_ids(pool, "gen")) == floor and len(_cached_ids(pool, "prm")) == 9
    pool.allocate(1, "prm")                        # then prm's own queued prefixes, not gen's floor
    assert len(_cached_ids(pool, "gen")) == floor and len(_cached_ids(pool, "prm")) == 8


def test_thrash_is_counted_by_the_model_whose_allocation_evicted_the_block():
    from treeserve.engine.kv_cache_manager import KVCacheManager
    from treeserve.engine.request import Request
    from treeserve.sampling_params import SamplingParams

    pool = BlockPool(4)
    gen, prm = KVCacheManager(block_size=4, pool=pool, owner="gen"), KVCacheManager(block_size=4, pool=pool, owner="prm")

    def prefill(kv, rid, tokens):
        request = Request(rid, list(tokens), SamplingParams())
        prefix = kv.find_cached_prefix(request)
        assert kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix)
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
        kv.free(request)

    prefill(prm, "a", range(9))              # 2 full blocks cached (+ a partial one)
    prefill(gen, "b", range(100, 116))       # gen takes all 4 blocks: evicts prm's 2
    prefill(prm, "c", range(9))              # prm asks for them again
    prefill(prm, "d", range(200, 216))       # prm's allocation evicts gen's 4 blocks
    prefill(gen, "e", range(100, 116))
    assert prm.stats.thrash == 2 and prm.stats.thrash_by_evictor == {"gen": 2}
    # (a lookup stops short of the last block: its last position's logits are computed)
    assert gen.stats.thrash == 3 and gen.stats.thrash_by_evictor == {"prm": 3}
    assert pool.stats.thrash_by_evictor == {"gen": 2, "prm": 3}
