"""Block pool and KV cache manager: LRU eviction order, counters, copy-on-write, fork, free."""
from treeserve.engine.block_pool import BlockPool
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import Request, hash_block
from treeserve.sampling_params import SamplingParams


def _request(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def _run_prefill(kv, request):
    prefix = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return prefix


def test_chained_hash_depends_on_parent_and_salt():
    a = hash_block(None, [1, 2], b"")
    assert a == hash_block(None, [1, 2], b"")
    assert a != hash_block(None, [1, 2], b"salt")
    assert hash_block(a, [3, 4], b"") != hash_block(hash_block(None, [9, 9], b""), [3, 4], b"")


def test_lru_evicts_least_recently_freed_and_tail_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free(reversed(blocks))  # a request frees tail first
    # order of free queue: the untouched block 3, then tail (2), middle (1), head (0)
    order = [b.block_id for b in pool.allocate(4)]
    assert order == [3, blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]
    assert pool.stats.evictions == 3


def test_prefix_hits_queries_evictions_and_thrash():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = _request("a", range(10))                 # 2 full blocks + 2 tokens
    _run_prefill(kv, first)
    kv.free(first)
    again = _request("b", range(10))
    prefix = _run_prefill(kv, again)
    assert prefix.num_tokens == 8
    assert kv.pool.stats.hits == 8 and kv.pool.stats.queries == 20
    kv.free(again)
    other = _request("c", range(100, 116))           # needs all 4 blocks: evicts the cached ones
    _run_prefill(kv, other)
    assert kv.pool.stats.evictions >= 2
    kv.free(other)
    thrash_before = kv.pool.stats.thrash
    _run_prefill(kv, _request("d", range(10)))      # asks for the evicted hashes again
    assert kv.pool.stats.thrash - thrash_before == 2


def test_salt_separates_caches():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", range(9), salt="alice")
    _run_prefill(kv, a)
    kv.free(a)
    assert _run_prefill(kv, _request("b", range(9), salt="bob")).num_tokens == 0


def test_fork_shares_blocks_and_copies_a_partial_tail_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _request("p", range(6))
    _run_prefill(kv, parent)
    children = [_request(f"c{i}", range(7)) for i in range(2)]
    for child in children:
        kv.fork(parent, child)
    tables = [kv.block_ids(c) for c in children]
    assert tables[0] == tables[1] == kv.block_ids(parent)
    kv.free(parent)
    assert kv.allocate_slots(children[0], 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == tables[0][1]
    assert kv.block_ids(children[0])[0] == tables[0][0]        # full block still shared
    assert kv.block_ids(children[0])[1] != tables[0][1]        # tail copied
    assert kv.allocate_slots(children[1], 1)
    assert kv.take_pending_copies() == []                      # last holder writes in place
    for child in children:
        kv.free(child)
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_the_arena_copies_each_pending_page_whole():
    import torch

    from treeserve.engine.kv_arena import KVArena

    arena = KVArena(num_pages=5, page_bytes=256, device=torch.device("cpu"))
    arena.pages.copy_(torch.randint(0, 256, arena.pages.shape, dtype=torch.uint8))
    before = arena.pages.clone()
    arena.copy_pages([(1, 3), (2, 0)])
    assert torch.equal(arena.pages[3], before[1]) and torch.equal(arena.pages[0], before[2])
    assert torch.equal(arena.pages[[1, 2, 4]], before[[1, 2, 4]])
    arena.copy_pages([])
    assert torch.equal(arena.pages[[1, 2, 4]], before[[1, 2, 4]])


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = _request("a", range(20))
    assert not kv.allocate_slots(request, 20)
    assert kv.pool.num_free == 2 and not kv.block_tables.get("a")


def test_in_use_counts_per_owner():
    from treeserve.engine.block_pool import BlockPool

    pool = BlockPool(6)
    gen = KVCacheManager(block_size=4, pool=pool, owner="gen")
    prm = KVCacheManager(block_size=2, pool=pool, owner="prm")
    a, b = _request("a", range(8)), _request("b", range(3))
    assert gen.allocate_slots(a, 8) and prm.allocate_slots(b, 3)
    assert (gen.num_blocks_in_use(), prm.num_blocks_in_use()) == (2, 2)
    assert sum(1 for blk in pool.blocks if blk.ref_count) == 4
    gen.free(a)
    assert (gen.num_blocks_in_use(), prm.num_blocks_in_use()) == (0, 2)
    prm.free(b)
    assert pool.num_free == 6 and prm.num_blocks_in_use() == 0
