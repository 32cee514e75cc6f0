"""Quantized weights on this CPU: decode tokens/s at batch 1, 16 and 64 and a 2k-token prefill, for the
weights as stored and int8 weight-only (`quantization="int8"`), on a Llama-3.2-1B-shaped model with
random weights made at load (benchmarks/gpu_models.py's; no checkpoint), each arm in a fresh
process, alternating, `--pairs` times; peak RSS of each. Prints medians and int8 / stored ratios.

Decode tokens/s: (the job's time - the same prompts' prefill alone) over the tokens after the first.

    python benchmarks/quantization.py [--pairs 2] [--dtype auto] [--output-tokens 32]
    python benchmarks/quantization.py --kernels   # one projection's forward: int8 kernel, dequantized
                                                  # GEMM and the stored layer, by rows (picks
                                                  # model/quantization.py's DEQUANTIZE_FROM_ROWS)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ARMS = {"stored": None, "int8": "int8"}
BATCHES = (1, 16, 64)
PROMPT_TOKENS = 256
PREFILL_TOKENS = 2000


def model_path() -> Path:
    from gpu_models import LLAMA_3_2_1B, model_dir
    from treeserve.model.registry import cache_dir

    return model_dir(cache_dir() / "bench-models", "llama-3.2-1b-shape", LLAMA_3_2_1B, 2048)


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child(arm: str, dtype: str, output_tokens: int) -> dict:
    from treeserve import LLM, SamplingParams

    llm = LLM(str(model_path()), dtype=dtype, device="cpu", quantization=ARMS[arm], load_format="dummy",
              max_model_len=2048, enable_prefix_caching=False, max_num_seqs=64, kv_cache_memory_bytes=1 << 30)
    rng = random.Random(0)

    def run(prompts, tokens):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run([[rng.randrange(10, 30000) for _ in range(64)]], 4)  # warm-up
    result = {"arm": arm, "dtype": str(llm.engine.dtype), "decode_tok_s": {}}
    for batch in BATCHES:
        prompts = [[rng.randrange(10, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        prefill = run(prompts, 1)
        whole = run(prompts, output_tokens)
        result["decode_tok_s"][batch] = batch * (output_tokens - 1) / (whole - prefill)
    long_prompt = [[rng.randrange(10, 30000) for _ in range(PREFILL_TOKENS)]]
    result["prefill_tok_s"] = PREFILL_TOKENS / run(long_prompt, 1)
    result["peak_rss"] = _peak_rss()
    return result


def kernels() -> None:
    import torch
    from torch import nn

    from treeserve.config import cpu_has_fast_bf16
    from treeserve.model import cpu_kernels
    from treeserve.model.packed_linear import pack_linears
    from treeserve.model.quantization import Int8Linear

    dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    for shape in ((2048, 8192), (8192, 2048)):
        stored = nn.Sequential(nn.Linear(*shape, bias=False).to(dtype))
        quantized = Int8Linear(stored[0])
        pack_linears(stored, dtype, torch.device("cpu"))
        for rows in (1, 4, 16, 32, 64, 128, 256, 1024):
            x = torch.randn(rows, shape[0], dtype=dtype)
            timings = {"int8 (ours)": lambda: cpu_kernels.int8_linear(cpu_kernels.load(), x, quantized.weight,
                                                                         quantized.scales),
                       "int8 (aten)": lambda: torch.ops.aten._weight_int8pack_mm(x, quantized.weight,
                                                                                 quantized.scales.to(dtype)),
                       "dequantized GEMM": lambda: nn.functional.linear(x, quantized.dequantized(dtype)),
                       "stored": lambda: stored(x)}
            row = []
            for name, fn in timings.items():
                for _ in range(3):
                    fn()
                times = []
                for _ in range(15):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                row.append(f"{name} {statistics.median(times) * 1e3:7.3f} ms")
            print(f"{dtype} {shape[0]}x{shape[1]} rows {rows:5d}: " + ", ".join(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--child", choices=list(ARMS))
    args = parser.parse_args()
    if args.kernels:
        kernels()
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.dtype, args.output_tokens)))
        return 0
    model_path()  # made once, before any timing
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for pair in range(args.pairs):
        for arm in (list(ARMS) if pair % 2 == 0 else list(reversed(ARMS))):
            out = subprocess.run([sys.executable, __file__, "--child", arm, "--dtype", args.dtype,
                                  "--output-tokens", str(args.output_tokens)], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{arm}: {out.stderr[-2000:]}")
            results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = results[arm][-1]
            print(f"pair {pair + 1} {arm} ({r['dtype']}): decode " + ", ".join(
                f"b{b} {v:.1f}" for b, v in r["decode_tok_s"].items()) + f" tok/s; prefill {r['prefill_tok_s']:.0f} "
                f"tok/s; peak RSS {r['peak_rss'] / 2**30:.2f} GiB", flush=True)
    median = {arm: {str(b): statistics.median(r["decode_tok_s"][str(b)] for r in rows) for b in BATCHES}
              | {"prefill": statistics.median(r["prefill_tok_s"] for r in rows),
                 "peak_rss": statistics.median(r["peak_rss"] for r in rows)} for arm, rows in results.items()}
    print("\nmedians:", json.dumps(median))
    for key in [str(b) for b in BATCHES] + ["prefill"]:
        label = f"decode batch {key}" if key != "prefill" else f"prefill {PREFILL_TOKENS} tokens"
        print(f"{label}: int8 / stored {median['int8'][key] / median['stored'][key]:.2f}x")
    print(f"peak RSS: int8 / stored {median['int8']['peak_rss'] / median['stored']['peak_rss']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
