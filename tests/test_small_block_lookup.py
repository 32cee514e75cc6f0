"""Prefix lookup with many small blocks (a verifier's 4-token pages in a shared arena): the faster
hashing and look-up give the answers the per-block code gave, and a toy two-model search makes
the scheduling decisions it made before (admissions, hits, evictions, thrash, preemptions)."""
import hashlib
import itertools
import random
from array import array

from treeserve.engine.block_pool import BlockPool
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import BACKGROUND_PRIORITY, Request, hash_block, hash_blocks
from treeserve.engine.scheduler import Scheduler
from treeserve.sampling_params import SamplingParams


def _reference_hash(parent, tokens, extra):
    """The per-block hash as first written (three updates of one digest)."""
    digest = hashlib.sha256(parent or b"root")
    digest.update(array("q", tokens).tobytes())
    digest.update(extra)
    return digest.digest()


def _reference_hashes(tokens, num_blocks, block_size, extra):
    hashes = []
    for index in range(num_blocks):
        parent = hashes[-1] if index else None
        hashes.append(_reference_hash(parent, tokens[index * block_size:(index + 1) * block_size], extra))
    return hashes


def test_run_hashes_are_the_per_block_hashes():
    rng = random.Random(0)
    for _ in range(200):
        block_size = rng.choice([1, 2, 4, 15, 16])
        tokens = [rng.randrange(-2**40, 2**40) for _ in range(rng.randrange(0, 120))]
        extra = rng.choice([b"", b"prm\x00", "gen\x00sälz".encode()])
        count = rng.randrange(0, len(tokens) // block_size + 3)  # past the end too: short and empty blocks
        assert hash_blocks(None, tokens, count, block_size, extra) == _reference_hashes(tokens, count, block_size, extra)
        parent = rng.randbytes(32)
        assert hash_block(parent, tokens[:block_size], extra) == _reference_hash(parent, tokens[:block_size], extra)


def test_request_hashes_extended_in_runs_are_the_per_block_hashes():
    rng = random.Random(1)
    for _ in range(50):
        block_size = rng.choice([4, 16])
        request = Request("r", [rng.randrange(50000) for _ in range(rng.randrange(1, 200))], SamplingParams(),
                          cache_salt=rng.choice([None, "s"]), cache_namespace=rng.choice(["", "prm"]))
        extra = f"{request.cache_namespace}\x00{request.cache_salt or ''}".encode()
        for _ in range(rng.randrange(1, 6)):  # extended piecemeal, as the prompt is looked up and tokens grow
            for _ in range(rng.randrange(0, 9)):
                request.append_output_token(rng.randrange(50000))
            num_blocks = rng.randrange(0, request.num_tokens // block_size + 1)
            request.ensure_block_hashes(num_blocks, block_size)
        full = request.num_tokens // block_size
        hashes = request.ensure_block_hashes(full, block_size)
        assert hashes[:full] == _reference_hashes(request.all_token_ids, full, block_size, extra)


def _reference_prefix(kv, request):
    """The prefix lookup as first written: one pool lookup per block, then the evicted misses."""
    max_blocks = request.max_cached_blocks(kv.block_size)
    hashes = request.ensure_block_hashes(max_blocks, kv.block_size)[:max_blocks]
    blocks = []
    for block_hash in hashes:
        block = kv.pool.lookup(block_hash)
        if block is None:
            break
        blocks.append(block)
    return blocks, [h for h in hashes[len(blocks):] if kv.pool.was_evicted(h)]


def test_prefix_lookup_finds_the_blocks_and_thrash_of_the_per_block_lookup():
    rng = random.Random(2)
    pool = BlockPool(40)
    kv = KVCacheManager(block_size=4, pool=pool, owner="prm")
    stems = [[rng.randrange(100) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    checked_hits = checked_thrash = 0
    for serial in range(300):
        tokens = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 24))]
        request = Request(f"r{serial}", tokens, SamplingParams())
        blocks, thrash = _reference_prefix(kv, request)
        prefix = kv.find_cached_prefix(request)
        assert [b.block_id for b in prefix.blocks] == [b.block_id for b in blocks]
        assert prefix.num_tokens == 4 * len(blocks) and prefix.thrash_hashes == thrash
        looked = kv.find_cached_prefix(request, with_thrash=False)  # ranking only: the same blocks, no thrash
        assert looked.blocks == prefix.blocks and looked.num_tokens == prefix.num_tokens and looked.thrash_hashes == []
        checked_hits += bool(blocks)
        checked_thrash += bool(thrash)
        if kv.can_allocate(request, request.num_tokens - prefix.num_tokens, prefix):
            kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix)
            request.num_computed_tokens = request.num_tokens
            kv.cache_full_blocks(request)
            kv.free(request)
    assert checked_hits > 50 and checked_thrash > 20  # both paths were exercised


def _toy_search(num_blocks):
    """A generator (16-token blocks) and a verifier (4-token blocks) sharing one pool: each round
    samples continuations of the kept paths, then scores every new path (prefill only)."""
    rng = random.Random(0)
    pool = BlockPool(num_blocks)
    gen = Scheduler(KVCacheManager(block_size=16, pool=pool, owner="gen"), 16, 512)
    prm = Scheduler(KVCacheManager(block_size=4, pool=pool, owner="prm"), 32, 1024)
    decisions, scores, pending, serial = [], {}, [], iter(range(10**6))

    def step(scheduler):
        out = scheduler.schedule()
        decisions.append(([(s.request.request_id, s.num_new_tokens) for s in out.scheduled],
                          [r.request_id for r in out.preempted]))
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            scheduler.kv.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue
            if request.prefill_only:
                scheduler.finish(request, "prefill")
                scores[request.path] = random.Random(request.request_id).random()
                continue
            request.append_output_token(random.Random(f"{request.request_id}/{request.num_output_tokens}").randrange(500))
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request, "length")
                pending.append(request.path + (tuple(request.output_token_ids),))

    def submit(scheduler, path, **options):
        request = Request(f"r{next(serial)}", [t for part in path for t in part], SamplingParams(),
                          priority=BACKGROUND_PRIORITY, **options)
        request.path = path
        scheduler.add(request)

    frontier = [((rng.randrange(500),) * 3 + tuple(rng.randrange(500) for _ in range(rng.randint(40, 120))),)
                for _ in range(6)]
    for _ in range(4):
        for path in frontier:
            for _ in range(3):
                submit(gen, path, max_tokens=rng.randint(8, 30))
        while gen.has_unfinished():
            step(gen)
        for path in pending:
            ends = list(itertools.accumulate(len(part) for part in path))
            submit(prm, path, prefill_only=True, logits_positions=[e - 1 for e in ends[1:]])
        pending.clear()
        while prm.has_unfinished():
            step(prm)
        frontier = [path for _, path in sorted((score, path) for path, score in scores.items())[-6:]]
        scores.clear()
    stats = pool.stats
    return (hashlib.sha256(repr(decisions).encode()).hexdigest()[:16], stats.queries, stats.hits, stats.evictions,
            stats.thrash, sorted(stats.thrash_by_evictor.items()), gen.num_preemptions + prm.num_preemptions)


def test_a_toy_search_makes_the_decisions_it_made_with_per_block_lookups():
    # recorded with the per-block hashing and lookup (commit 26c3d4f); a change here is a
    # scheduling change, not a speed-up
    tight = ("21a5f583eaec8799", 17349, 11792, 1007, 284, [("gen", 24), ("prm", 260)], 0)
    roomy = ("7651900e4b4b54f5", 17127, 13056, 356, 4, [("prm", 4)], 0)
    assert _toy_search(60) == tight
    assert _toy_search(400) == roomy


def _reference_set_wanted(pool, owner, blocks):
    """`BlockPool.set_wanted` as first written: every mention of a block, in list order."""
    keep = {b.block_id for b in blocks}
    for block in pool.wanted_by_owner.get(owner, ()):
        if block.block_id not in keep:
            pool.free_blocks.unwant(block, owner)
    for block in blocks:
        if block.wanted_by != owner:
            pool.free_blocks.want(block, owner)
    pool.wanted_by_owner[owner] = list(blocks)


def _free_queues(pool):
    tiers = {"empty": {"": pool.free_blocks.empty}, "probation": pool.free_blocks.probation,
             "protected": pool.free_blocks.protected, "wanted": pool.free_blocks.wanted}
    return {(tier, owner): [(b.block_id, b.freed_at, b.wanted_by) for b in queue.values()]
            for tier, queues in tiers.items() for owner, queue in queues.items()}


def test_wanted_blocks_listed_many_times_are_queued_as_the_per_mention_loop_queued_them():
    rng = random.Random(3)
    pools = [BlockPool(32), BlockPool(32)]
    for pool in pools:
        for index in range(32):
            (block,) = pool.allocate(1, "prm" if index % 3 else "gen")
            pool.cache_block(block, bytes([index]))
            block.reused = index % 2 == 0
        pool.free(reversed(pool.blocks[::2]))  # half are free (cached), half held
    for _ in range(40):
        owner = rng.choice(["gen", "prm"])
        ids = [rng.randrange(32) for _ in range(rng.randrange(0, 30))]  # repeats: prefixes many requests share
        _reference_set_wanted(pools[0], owner, [pools[0].blocks[i] for i in ids])
        pools[1].set_wanted(owner, [pools[1].blocks[i] for i in ids])
        assert _free_queues(pools[1]) == _free_queues(pools[0])
        assert {o: [b.block_id for b in bs] for o, bs in pools[1].wanted_by_owner.items()} == \
            {o: [b.block_id for b in bs] for o, bs in pools[0].wanted_by_owner.items()}
