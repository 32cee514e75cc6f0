"""treeserve's paged attention kernel (`cpu_kernels.paged_attention`) on one decode step: `--rows`
sequences of about `--context` tokens (each within 0.5x-1.5x of it), their blocks scattered over a
cache larger than the CPU's caches, 12 query heads over 4 KV heads of 64 (the mixed workload's
model, benchmarks/peers.py), per dtype: median time, KV bytes read per second, and the largest
difference from a float64 softmax reference.

    python benchmarks/paged_decode.py [--rows 96] [--context 100,400,1600] [--dtypes bfloat16,float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treeserve.model import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 12, 4, 64, 16, 8192


def decode_rows(rows: int, context: int, dtype: torch.dtype, gen: torch.Generator):
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.randint(max(1, context // 2), context * 3 // 2 + 1, (rows,), generator=gen).sort().values
    width = -(-int(lens.max()) // BLOCK_SIZE)
    tables = torch.randint(0, NUM_BLOCKS, (rows, width), generator=gen)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return cache, tables, lens, q


def reference(q, cache, tables, lens, scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, length in enumerate(lens.tolist()):
        ids = tables[i, : -(-length // BLOCK_SIZE)]
        keys = cache[ids, 0].reshape(-1, KV_HEADS, HEAD_DIM)[:length].double().repeat_interleave(HEADS // KV_HEADS, 1)
        values = cache[ids, 1].reshape(-1, KV_HEADS, HEAD_DIM)[:length].double().repeat_interleave(HEADS // KV_HEADS, 1)
        probs = torch.einsum("hd,thd->ht", q[i].double() * scale, keys).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", probs, values)
    return out


def time_kernel(library, rows: int, context: int, dtype: torch.dtype, repeats: int) -> dict:
    cache, tables, lens, q = decode_rows(rows, context, dtype, torch.Generator().manual_seed(0))
    starts = torch.arange(rows) * tables.shape[1]
    block_ids = tables.flatten().contiguous()
    out, scale = torch.empty_like(q), HEAD_DIM ** -0.5

    def run():
        cpu_kernels.paged_attention(library, q, cache, block_ids, starts, lens, scale, None, out)

    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
    error = (out.double() - reference(q, cache, tables, lens, scale)).abs().max().item()
    return {"ms": median * 1e3, "gb_s": kv_bytes / median / 1e9, "max_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--context", default="100,400,1600")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    library = cpu_kernels.load()
    if library is None:
        raise SystemExit("treeserve's CPU kernels could not be built here")
    probe = getattr(library, "ts_paged_bf16_tiles", None)  # absent before session 58's kernel
    bf16_tiles = probe is not None and probe(HEAD_DIM) == 1
    print(f"{torch.get_num_threads()} threads; bfloat16 tiles through vdpbf16ps: {'yes' if bf16_tiles else 'no'}")
    for context in map(int, args.context.split(",")):
        for name in args.dtypes.split(","):
            r = time_kernel(library, args.rows, context, getattr(torch, name), args.repeats)
            print(f"{name:9s} rows {args.rows} context ~{context}: {r['ms']:.3f} ms, {r['gb_s']:.1f} GB/s of KV, "
                  f"max |error| {r['max_error']:.2g}")


if __name__ == "__main__":
    main()
