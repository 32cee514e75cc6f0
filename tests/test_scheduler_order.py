"""Admission order: interactive requests first come first served; background (search and
verifier) work longest cached prefix first, with a bound on how long any request is passed over;
the prefixes of waiting requests are marked wanted and forgotten once nothing waits."""
from treeserve.engine import scheduler as scheduler_module
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import BACKGROUND_PRIORITY, Request
from treeserve.engine.scheduler import Scheduler
from treeserve.sampling_params import SamplingParams

BLOCK = 4


def _request(rid, tokens, priority=BACKGROUND_PRIORITY):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), priority=priority)


def _scheduler(num_blocks=64, budget=1024, max_seqs=64):
    return Scheduler(KVCacheManager(num_blocks, block_size=BLOCK, owner="m"), max_seqs, budget)


def _complete(scheduler, out):
    """Computes what was scheduled and finishes every request (their blocks stay cached)."""
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_new_tokens
        scheduler.kv.cache_full_blocks(item.request)
    for item in out.scheduled:
        scheduler.finish(item.request, "length")


def _warm(scheduler, tokens):
    """Leaves `tokens` in the prefix cache."""
    budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, len(tokens)
    scheduler.add(_request("warm", tokens))
    _complete(scheduler, scheduler.schedule())
    scheduler.max_num_batched_tokens = budget


def _admitted(out):
    return [s.request.request_id for s in out.scheduled if s.request.request_id != "runner"]


def test_background_work_with_a_cached_prefix_goes_first():
    scheduler = _scheduler(budget=40)
    cached = list(range(100, 124))
    _warm(scheduler, cached + [1])
    scheduler.add(_request("cold", range(200, 230)))
    scheduler.add(_request("hit", cached + [2, 3, 4, 5]))
    out = scheduler.schedule()
    assert _admitted(out) == ["hit", "cold"]
    assert out.scheduled[0].num_new_tokens == 4  # 24 of its 28 tokens were cached (6 full blocks)


def test_interactive_requests_keep_arrival_order():
    scheduler = _scheduler(budget=40)
    cached = list(range(100, 124))
    _warm(scheduler, cached + [1])
    scheduler.add(_request("cold", range(200, 230), priority=0))
    scheduler.add(_request("hit", cached + [2, 3], priority=0))
    assert _admitted(scheduler.schedule()) == ["cold", "hit"]


def test_a_request_passed_over_too_often_goes_first(monkeypatch):
    monkeypatch.setattr(scheduler_module, "MAX_PASSED_OVER", 2)
    scheduler = _scheduler(budget=12, max_seqs=1)
    cached = list(range(100, 124))
    _warm(scheduler, cached + [1])
    scheduler.add(_request("cold", range(200, 210)))
    admitted = []
    for i in range(4):  # a new cache hit arrives every step
        scheduler.add(_request(f"hit{i}", cached + [50 + i]))
        out = scheduler.schedule()
        admitted += _admitted(out)
        _complete(scheduler, out)
    assert admitted[:2] == ["hit0", "hit1"] and admitted[2] == "cold"


def test_waiting_prefixes_are_wanted_until_nothing_waits():
    scheduler = _scheduler(budget=8, max_seqs=1)
    cached = list(range(100, 124))
    _warm(scheduler, cached + [1])
    pool = scheduler.kv.pool
    scheduler.add(_request("busy", range(300, 306)))
    scheduler.add(_request("queued", cached + [9]))
    out = scheduler.schedule()  # one slot: "queued" has the longer prefix, so it goes; "busy" waits
    assert _admitted(out) == ["queued"]
    scheduler.add(_request("later", cached + [10]))
    _complete(scheduler, out)
    scheduler.schedule()  # "later" (a hit) goes, "busy" waits: nothing of "busy" is cached
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert waiting_ids == ["busy"]
    scheduler.add(_request("hit-waits", cached + [11]))
    scheduler.schedule()  # the slot is taken: "hit-waits" waits, and its prefix is wanted
    assert {b.block_id for b in pool.wanted_by_owner["m"]} == {b.block_id for b in pool.blocks
                                                               if b.wanted_by == "m"}
    assert len(pool.wanted_by_owner["m"]) == 6
    for request in list(scheduler.waiting):
        scheduler.finish(request, "abort")  # the last waiting request leaves: nothing is wanted
    assert not pool.wanted_by_owner["m"] and not any(b.wanted_by for b in pool.blocks)


def test_a_request_that_would_evict_a_waiting_requests_prefix_waits_a_step():
    scheduler = _scheduler(num_blocks=10, budget=64, max_seqs=1)
    prefix = list(range(100, 124))                      # 6 cached blocks
    _warm(scheduler, prefix + [1])
    scheduler.add(_request("runner", range(300, 307)))  # takes 2 of the 4 empty blocks
    assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["runner"]
    scheduler.max_num_seqs = 8
    scheduler.add(_request("cold", range(400, 415)))    # 4 blocks: 2 empty ones, then the prefix
    scheduler.add(_request("hit", prefix + [2], priority=BACKGROUND_PRIORITY + 1))  # tried after "cold"
    out = scheduler.schedule()
    assert _admitted(out) == ["hit"]                    # "cold" waits for "runner" to free its blocks
    assert out.scheduled[-1].num_new_tokens == 1        # "hit" found its whole prefix
    _complete(scheduler, out)                           # both end
    assert _admitted(scheduler.schedule()) == ["cold"]


def test_interactive_requests_are_not_held_back_for_queued_work():
    scheduler = _scheduler(num_blocks=10, budget=64, max_seqs=1)
    prefix = list(range(100, 124))
    _warm(scheduler, prefix + [1])
    scheduler.add(_request("runner", range(300, 307)))
    scheduler.schedule()
    scheduler.max_num_seqs = 8
    scheduler.add(_request("chat", range(400, 415), priority=0))
    scheduler.add(_request("hit", prefix + [2]))
    assert _admitted(scheduler.schedule())[0] == "chat"


def test_while_another_model_waits_for_the_pool_only_forks_that_hold_blocks_are_admitted():
    """A shared pool whose other model waits for blocks (the engine loop lists it in
    `stalled_owners`): new requests wait, so the blocks that free go to that model; a fork that holds
    blocks already is admitted (it ends and frees them: leaving it waiting could pin them for good)."""
    scheduler = _scheduler()
    parent = _request("parent", range(9))
    scheduler.add(parent)
    out = scheduler.schedule()
    parent.num_computed_tokens += out.scheduled[0].num_new_tokens
    fork = _request("fork", range(10))
    scheduler.kv.fork(parent, fork)  # (as a request's n samples fork from its shared prefill)
    scheduler.finish(parent, "length")
    scheduler.add(fork)
    scheduler.add(_request("new", range(300, 310)))
    scheduler.kv.pool.stalled_owners.add("verifier")
    out = scheduler.schedule()
    assert out.yielded and _admitted(out) == ["fork"]
    scheduler.kv.pool.stalled_owners.clear()
    out = scheduler.schedule()
    assert not out.yielded and "new" in _admitted(out)
