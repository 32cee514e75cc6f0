"""Peak memory of one long prefill: treeserve's peak RSS for one prompt of each length against the
weights, the prompt's KV and a workspace that does not grow with the prompt.

Each prompt runs in a fresh process (peak RSS is a process's lifetime maximum) with a KV pool of
just the blocks the prompt needs (the pool is zeroed, so it is resident from the start). The
workspace is measured once, as what a process that prefills one chunk (`--chunk` tokens, the step's
token budget) holds beyond its weights and KV: the Python and PyTorch runtime, one chunk's
activations, the allocator's slack. A longer prompt should need only its extra KV blocks on top:
its peak against weights + KV + that workspace is the check (issue 41: within 10%).

    python benchmarks/long_prompt_memory.py [--lengths 8192,16384,32768] [--chunk 2048]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

from treeserve.bench.offline import LONG_PROMPT_SHAPE, long_prompt_model_dir

MIB = 1 << 20


def child(length: int, chunk: int) -> dict:
    """Prefills one prompt of `length` tokens (1 output token) here; its figures."""
    from treeserve import LLM, SamplingParams

    model = long_prompt_model_dir()
    per_token = 2 * LONG_PROMPT_SHAPE["num_hidden_layers"] * LONG_PROMPT_SHAPE["num_key_value_heads"] * (
        LONG_PROMPT_SHAPE["hidden_size"] // LONG_PROMPT_SHAPE["num_attention_heads"]) * 4  # float32 K and V
    llm = LLM(str(model), dtype="float32", device="cpu", enable_prefix_caching=False, max_num_batched_tokens=chunk,
              max_model_len=length + 1, kv_cache_memory_bytes=per_token * (length + 64), max_num_seqs=1)
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    kv = llm.engine.runner.arena.pages.numel()
    rng = random.Random(length)
    ids = [rng.randrange(10, LONG_PROMPT_SHAPE["vocab_size"]) for _ in range(length)]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return {"length": length, "seconds": time.perf_counter() - start, "weights": weights, "kv": kv,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10}


def measure(length: int, chunk: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", str(length), "--chunk", str(chunk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {length}-token run failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.chunk)))
        return 0
    base = measure(args.chunk, args.chunk)
    workspace = base["peak_rss"] - base["weights"] - base["kv"]
    print(f"one chunk ({args.chunk} tokens): peak RSS {base['peak_rss'] / MIB:.0f} MiB = weights "
          f"{base['weights'] / MIB:.0f} + KV {base['kv'] / MIB:.0f} + workspace {workspace / MIB:.0f} MiB")
    print(f"{'prompt':>7}{'seconds':>9}{'weights':>9}{'KV':>8}{'expected':>10}{'peak RSS':>10}{'peak/expected':>15}")
    worst = 0.0
    for length in [int(x) for x in args.lengths.split(",") if x]:
        row = measure(length, args.chunk)
        expected = row["weights"] + row["kv"] + workspace
        worst = max(worst, row["peak_rss"] / expected)
        print(f"{length:>7}{row['seconds']:>9.1f}{row['weights'] / MIB:>8.0f}M{row['kv'] / MIB:>7.0f}M"
              f"{expected / MIB:>9.0f}M{row['peak_rss'] / MIB:>9.0f}M{row['peak_rss'] / expected:>15.3f}", flush=True)
    print(f"largest peak / (weights + KV + workspace): {worst:.3f} ({'within' if worst <= 1.1 else 'over'} 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
