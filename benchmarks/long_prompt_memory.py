"""Peak memory of one long prefill: treeserve's peak RSS while it prefills one prompt, against
what was resident before (the runtime, the weights and the prompt's KV pool) plus a workspace that
does not grow with the prompt.

Each prompt runs in a fresh process with a KV pool of just the blocks it needs (the pool is
zeroed, so resident from the start). The peak is the kernel's high-water mark (VmHWM), reset
(`/proc/self/clear_refs`) after the model and pool are in place, so loading's transients (the
safetensors mapping beside the materialised weights) do not count. The workspace is measured once,
as the growth while prefilling one chunk (`--chunk` tokens, the step's token budget): one chunk's
activations and the allocator's slack. A longer prompt should need nothing more: its peak against
resident-before + that workspace is the check (issue 41: within 10%).

    python benchmarks/long_prompt_memory.py [--lengths 8192,16384,32768] [--chunk 2048]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

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
    kv = llm.engine.stats().kv_arena_bytes
    rng = random.Random(length)
    ids = [rng.randrange(10, LONG_PROMPT_SHAPE["vocab_size"]) for _ in range(length)]
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return {"length": length, "seconds": time.perf_counter() - start, "weights": weights, "kv": kv,
            "before": before, "peak_rss": _status_bytes("VmHWM")}


def _status_bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) << 10  # kB


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
    workspace = base["peak_rss"] - base["before"]
    print(f"one chunk ({args.chunk} tokens): RSS {base['before'] / MIB:.0f} MiB before the prefill (weights "
          f"{base['weights'] / MIB:.0f}, KV {base['kv'] / MIB:.0f}, runtime the rest), peak "
          f"{base['peak_rss'] / MIB:.0f} MiB: workspace {workspace / MIB:.0f} MiB")
    print(f"{'prompt':>7}{'seconds':>9}{'weights':>9}{'KV':>8}{'runtime':>9}{'+ workspace':>13}{'peak RSS':>10}"
          f"{'peak/expected':>15}")
    worst = 0.0
    for length in [int(x) for x in args.lengths.split(",") if x]:
        row = measure(length, args.chunk)
        expected = row["before"] + workspace
        runtime = row["before"] - row["weights"] - row["kv"]
        worst = max(worst, row["peak_rss"] / expected)
        print(f"{length:>7}{row['seconds']:>9.1f}{row['weights'] / MIB:>8.0f}M{row['kv'] / MIB:>7.0f}M"
              f"{runtime / MIB:>8.0f}M{expected / MIB:>12.0f}M{row['peak_rss'] / MIB:>9.0f}M"
              f"{row['peak_rss'] / expected:>15.3f}", flush=True)
    print(f"largest peak / (weights + KV + runtime + workspace): {worst:.3f} "
          f"({'within' if worst <= 1.1 else 'over'} 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
