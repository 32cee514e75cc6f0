"""The host's cost of KV block allocation (#59: a shared arena's 4-token pages mean ~4x as many
blocks taken a step): `BlockPool.allocate` of runs of blocks that evict cached prefixes two
models left on probation, and `KVCacheManager.allocate_slots` for decodes (most of which need no
new block). Thread CPU time, the median of the repeats.

    python benchmarks/block_alloc.py                        # both, the replica's 8,192 pages
    python benchmarks/block_alloc.py --run 64 --blocks 32768

Compare two versions of the code by running this alternately on each (`PYTHONPATH` at a `git
worktree` of the other), as the machine drifts.
"""
from __future__ import annotations

import argparse
import statistics
import time

from treeserve.engine.block_pool import BlockPool

PROMPT_TOKENS = 100  # each decoding request's prompt


def cached_pool(num_blocks: int, run: int) -> BlockPool:
    """A pool whose every block holds a cached prefix on probation, the two models' interleaved."""
    pool = BlockPool(num_blocks)
    owners = ("gen", "prm")
    for owner in owners:
        pool.add_owner(owner)
    serial = 0
    while pool.free_blocks.empty:
        for owner in owners:
            blocks = pool.allocate(min(run, len(pool.free_blocks.empty)), owner)
            for block in blocks:
                pool.cache_block(block, serial.to_bytes(8, "big") * 4)
                serial += 1
            pool.free(reversed(blocks))
    return pool


def time_allocate(num_blocks: int, run: int) -> float:
    """Seconds a block: the whole pool taken back in runs of `run` blocks, each evicting."""
    pool = cached_pool(num_blocks, run)
    start = time.thread_time()
    taken = 0
    while pool.num_free >= run:
        pool.allocate(run, "prm")
        taken += run
    return (time.thread_time() - start) / taken


def time_decodes(num_requests: int, steps: int, block_size: int) -> float:
    """Seconds a decode's `allocate_slots` (one token; a new block every `block_size` steps)."""
    from treeserve.engine.kv_cache_manager import KVCacheManager
    from treeserve.engine.request import Request
    from treeserve.sampling_params import SamplingParams

    kv = KVCacheManager(num_requests * -(-(PROMPT_TOKENS + steps) // block_size), block_size)
    requests = [Request(f"r{i}", list(range(i, i + PROMPT_TOKENS)), SamplingParams(max_tokens=steps))
                for i in range(num_requests)]
    for request in requests:
        _allocate(kv, request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    start = time.thread_time()
    for _ in range(steps):
        for request in requests:
            if not kv.allocate_slots(request, 1):  # (the pool holds every decode: timing a refusal is wrong)
                raise RuntimeError(f"{request.request_id}'s decode found the pool short")
            request.num_computed_tokens += 1
    return (time.thread_time() - start) / (steps * num_requests)


def _allocate(kv, request, num_tokens: int) -> None:
    if not kv.allocate_slots(request, num_tokens):
        raise RuntimeError(f"{request.request_id}'s {num_tokens} slots found the pool short")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8192, help="pool size (the replica's shared arena: 8,192)")
    parser.add_argument("--run", type=int, default=16, help="blocks a call to allocate takes")
    parser.add_argument("--requests", type=int, default=64, help="decoding requests")
    parser.add_argument("--steps", type=int, default=512, help="decode steps")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("blocks", "run", "requests", "steps", "block_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.run > args.blocks:
        parser.error(f"--run {args.run}: a call cannot take more than the pool's {args.blocks} blocks")
    allocate = statistics.median(time_allocate(args.blocks, args.run) for _ in range(args.repeats))
    print(f"allocate, runs of {args.run} evicting blocks: {allocate * 1e9:.0f} ns a block")
    decode = statistics.median(time_decodes(args.requests, args.steps, args.block_size) for _ in range(args.repeats))
    print(f"allocate_slots, a decode ({args.block_size}-token blocks): {decode * 1e9:.0f} ns")


if __name__ == "__main__":
    main()
