"""Quantized checkpoints against vLLM CPU on the same files: decode tokens/s at batch 1 and 16 for the
Llama-3.2-1B-shaped checkpoints `benchmarks/quantization.py` writes (`gptq-w4a16`, `gptq-w4a16-head`
with its LM head quantized too, `ct-w8a8`, and `bfloat16`, the unquantized file its `stored` and
`int8` arms read), each engine in a fresh process per checkpoint, alternating, and the ratio.
A checkpoint vLLM cannot load is reported with its error.

Decode tokens/s: B prompts of 64 random tokens, generated to 33 tokens (EOS ignored) and to 1; the
difference in time over B x 32 tokens.

    python benchmarks/quantization.py --pairs 1 --arms gptq-w4a16 ct-w8a8 ...   # writes the checkpoints
    python benchmarks/quantized_peers.py [--arms gptq-w4a16,ct-w8a8] [--pairs 1]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 16)
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 33
MODELS = Path.home() / ".cache/treeserve/bench-models"
VLLM_PYTHON = Path.home() / ".cache/treeserve/peers/vllm/bin/python"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def prompts(batch: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def child(engine: str, model: str) -> dict:
    """In the engine's own process: decode tokens/s per batch."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    if engine == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt
        llm = LLM(model, dtype="bfloat16", max_model_len=512, enforce_eager=True)

        def generate(batch, tokens):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    else:
        from treeserve import LLM, SamplingParams
        llm = LLM(model, dtype="bfloat16", max_model_len=512)

        def generate(batch, tokens):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    result = {}
    for size in BATCHES:
        batch = prompts(size, vocab)
        generate(batch, 2)  # warm-up
        start = time.perf_counter()
        generate(batch, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(batch, OUTPUT_TOKENS)
        total = time.perf_counter() - start
        result[str(size)] = size * (OUTPUT_TOKENS - 1) / max(total - prefill, 1e-9)
    return result


def run(engine: str, model: Path) -> dict:
    python = str(VLLM_PYTHON) if engine == "vllm" else sys.executable
    env = dict(os.environ, **(VLLM_ENV if engine == "vllm" else {}))
    done = subprocess.run([python, __file__, "--child", engine, "--model", str(model)], capture_output=True, text=True,
                          env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        error = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
        return {"error": (error[-1] if error else done.stderr.strip()[-300:])[:300]}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="gptq-w4a16,ct-w8a8")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--child", choices=["treeserve", "vllm"])
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model)))
        return
    for arm in args.arms.split(","):
        model = MODELS / f"llama-3.2-1b-shape-{arm}"
        runs = {"treeserve": [], "vllm": []}
        for pair in range(args.pairs):
            for engine in (("treeserve", "vllm") if pair % 2 == 0 else ("vllm", "treeserve")):
                runs[engine].append(run(engine, model))
                print(f"{arm} pair {pair + 1} {engine}: {runs[engine][-1]}", flush=True)
        for size in map(str, BATCHES):
            ours = [r[size] for r in runs["treeserve"] if size in r]
            theirs = [r[size] for r in runs["vllm"] if size in r]
            if ours and theirs:
                print(f"{arm} batch {size}: treeserve {statistics.median(ours):.1f}, vLLM CPU {statistics.median(theirs):.1f} "
                      f"tok/s: {statistics.median(ours) / statistics.median(theirs):.2f}x")
            else:
                print(f"{arm} batch {size}: treeserve {ours}, vLLM CPU {theirs or runs['vllm'][-1].get('error')}")


if __name__ == "__main__":
    main()
