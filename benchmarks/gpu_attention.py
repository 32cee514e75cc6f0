"""Decode attention on the GPU: the unified kernel against split-KV at each split count and tile
size, per batch size (one layer of the Llama-3.2-1B shape: 32 query / 8 KV heads of 64, context ~1k,
bfloat16), each against the bound (the K/V bytes read / the measured copy bandwidth). Then picks the
policy (`SPLIT_PROGRAMS_PER_SM`, `DECODE_TILE_N`) whose choices lose least across the batch sizes.

    PYTHONPATH=src python3 benchmarks/gpu_attention.py        # on the GPU machine
    (gpu.py's `attention` section runs it and applies the policy to the sections after it)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_models as gm  # noqa: E402

from treeserve.model import triton_backend  # noqa: E402

SPLITS = (2, 4, 8, 16, 32)
TILES = (32, 64, 128)
PER_SM = (1, 2, 4, 8, 16, 32)


def inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block: int, device, dtype):
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks, 2, block, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
    return q, cache[:, 0], cache[:, 1], tables, seq_lens, starts


def time_us(fn) -> float:
    if not torch.cuda.is_available():  # the smoke run: once, to check the calls
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing  # replayed from a CUDA graph, as the engine runs decode: the launch costs out
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def measure(batch: int, context: int, device, shape=(32, 8, 64), block: int = 16, dtype=torch.bfloat16) -> dict:
    from treeserve.model.kernels import paged_attention as pa
    heads, kv_heads, head_dim = shape
    q, k_cache, v_cache, tables, seq_lens, starts = inputs(batch, context, heads, kv_heads, head_dim, block, device,
                                                           dtype)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    times = {"unified": time_us(lambda: pa.unified_attention(q, k_cache, v_cache, out, starts, seq_lens, tables,
                                                            scale, None))}
    for tile in TILES:
        pa.DECODE_TILE_N = tile
        for splits in SPLITS:
            buffers = pa.split_kv_buffers(batch, heads, head_dim, splits, device)
            times[f"split{splits}_tile{tile}"] = time_us(
                lambda: pa.split_kv_decode(q, k_cache, v_cache, out, seq_lens, tables, scale, None, buffers))
    pa.DECODE_TILE_N = pa.TILE_N
    return times


def policy_splits(per_sm: int, sms: int, batch: int, kv_heads: int) -> int:
    backend = triton_backend.TritonBackend.__new__(triton_backend.TritonBackend)
    backend.num_kv_heads, backend.split_kv_min_programs = kv_heads, per_sm * sms
    return backend.num_splits(batch)


def choose(table: dict, sms: int, kv_heads: int) -> dict:
    """The (programs per SM, tile) minimising the sum over batches of time / that batch's best."""
    scores = {}
    for per_sm in PER_SM:
        for tile in TILES:
            total = 0.0
            for batch, times in table.items():
                splits = policy_splits(per_sm, sms, int(batch), kv_heads)
                chosen = times["unified"] if splits == 0 else times[f"split{splits}_tile{tile}"]
                total += chosen / min(times.values())
            scores[(per_sm, tile)] = total
    (per_sm, tile), score = min(scores.items(), key=lambda item: item[1])
    return {"per_sm": per_sm, "tile": tile, "loss": score / len(table),
            "scores": {f"{p}/{t}": s / len(table) for (p, t), s in scores.items()}}


def apply(choice: dict) -> None:
    from treeserve.model.kernels import paged_attention as pa
    triton_backend.SPLIT_PROGRAMS_PER_SM = choice["per_sm"]
    pa.DECODE_TILE_N = choice["tile"]


def sweep(device, batches=(1, 8, 64, 256), context: int = 1000, smoke: bool = False) -> dict:
    if smoke:  # here, under the interpreter: tiny shapes, float32, figures meaningless
        bandwidth, sms, extra = 1e10, 4, dict(shape=(16, 8, 16), dtype=torch.float32)
    else:
        bandwidth, sms, extra = gm.copy_bandwidth(device), torch.cuda.get_device_properties(device).multi_processor_count, {}
    table, bounds = {}, {}
    for batch in batches:
        table[batch] = measure(batch, context, device, **extra)
        bounds[batch] = batch * context * 8 * 64 * 2 * 2 / bandwidth * 1e6
        best = min(table[batch], key=table[batch].get)
        print(f"batch {batch}: unified {table[batch]['unified']:.1f} us, best {best} {table[batch][best]:.1f} us, "
              f"bound {bounds[batch]:.1f} us", flush=True)
    choice = choose(table, sms, 8)
    print(f"policy: SPLIT_PROGRAMS_PER_SM={choice['per_sm']} DECODE_TILE_N={choice['tile']} "
          f"(mean time / best {choice['loss']:.3f})")
    return {"us": table, "bound_us": bounds, "choice": choice, "sms": sms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/gpu"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.smoke:
        result = sweep(torch.device("cpu"), batches=(1, 3), context=40, smoke=True)
    else:
        result = sweep(torch.device("cuda"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
