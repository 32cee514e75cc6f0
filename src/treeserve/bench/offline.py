"""Offline throughput: treeserve vs HF transformers' static-batched `generate`, same run, same machine.

A ~150M-parameter random Llama; a mixed-length workload (fixed seed; prompts 32-512 tokens,
outputs 16-256 tokens, EOS ignored). Prints output tokens/s for both, their ratio, and model-FLOPs
utilisation against a matmul peak measured here in the same dtype.

    treeserve bench throughput [--num-prompts 64] [--dtype auto|float32|bfloat16] [--tensor-parallel-size 1,2]
    python benchmarks/throughput.py ...   (the same)

With `--tensor-parallel-size 1,2` treeserve runs the workload at each size in turn and prints the
ratio of each to the first.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from treeserve import LLM, SamplingParams
from treeserve.config import EngineConfig
from treeserve.model.random_models import make_tiny_model
from treeserve.model.registry import cache_dir

MODEL_SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2304, num_hidden_layers=14,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                   tie_word_embeddings=False, initializer_range=0.02)


def benchmark_model_dir() -> Path:
    return _random_llama("llama-150m-random", MODEL_SHAPE)

# The long-prompt sweep's model (benchmarks/prompt_length.py, benchmarks/sweep_long_prompts.yaml):
# a 168M random Llama of issue 41's shape, 16/4 heads of 64, room for 32k-token prompts.
LONG_PROMPT_SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=33280,
                         tie_word_embeddings=True, initializer_range=0.02)


def long_prompt_model_dir() -> Path:
    return _random_llama("llama-168m-long-random", LONG_PROMPT_SHAPE)


def _random_llama(name: str, shape: dict) -> Path:
    """The benchmark model `name` in treeserve's cache, written (seed 0) on first use."""
    path = cache_dir() / "bench" / name
    if not (path / "config.json").is_file():
        make_tiny_model("llama", path, seed=0, **shape)
    return path


def n_params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                   else _prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def workload(num_prompts: int, seed: int, vocab: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(num_prompts):
        prompts.append([rng.randrange(10, vocab) for _ in range(rng.randint(32, 512))])
        lengths.append(rng.randint(16, 256))
    return prompts, lengths


def matmul_peak_tflops(dtype: torch.dtype, device: torch.device = torch.device("cpu"), size: int = 2048,
                       reps: int = 10) -> float:
    """Best of `reps` square matmuls: the machine's attainable GEMM rate in this dtype right now."""
    if device.type == "cuda":
        size *= 4  # a GPU needs larger products to reach its rate
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    a @ b
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e12


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops(prompts, lengths, shape) -> float:
    """Useful FLOPs: linear layers for every token, lm_head per generated token, causal attention."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * shape["intermediate_size"]
    total = 0.0
    for prompt, out in zip(prompts, lengths):
        tokens = len(prompt) + out - 1  # the last generated token is never fed back
        total += 2 * layers * per_layer * tokens + 2 * h * shape["vocab_size"] * out
        total += layers * 4 * h * tokens * (tokens + 1) / 2  # QK^T and AV over the causal context
    return total


def run_treeserve(path, dtype, prompts, lengths, args, tensor_parallel_size: int = 1) -> float:
    with LLM(str(path), dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_bytes,
             enable_prefix_caching=False, tensor_parallel_size=tensor_parallel_size) as llm:
        llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    return elapsed


def run_hf(path, dtype, prompts, lengths, batch_size, device: torch.device) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return hf_static_batches(model, prompts, lengths, batch_size, device, pad=0)


def hf_static_batches(model, prompts, lengths, batch_size, device: torch.device, pad: int) -> float:
    """Seconds for HF `generate` in static batches (left padding), each batch run to its longest output."""
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, outs = prompts[first:first + batch_size], lengths[first:first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs),
                           min_new_tokens=max(outs), pad_token_id=pad)
    _synchronize(device)
    return time.perf_counter() - start


def run(args) -> int:
    torch.set_num_threads(torch.get_num_threads())
    device = torch.device(args.device)
    dtype = EngineConfig(model=".", dtype=args.dtype).resolve_dtype(device, None)
    path = benchmark_model_dir()
    prompts, lengths = workload(args.num_prompts, args.seed, MODEL_SHAPE["vocab_size"])
    useful_tokens = sum(lengths)
    peak = matmul_peak_tflops(dtype, device)
    flops = model_flops(prompts, lengths, MODEL_SHAPE)
    print(f"model: random Llama ~{n_params(path) / 1e6:.0f}M params, dtype={dtype}, device={device}, "
          f"threads={torch.get_num_threads()}")
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {useful_tokens} output tokens")
    print(f"measured {dtype} matmul peak (before the runs): {peak:.3f} TFLOP/s")

    sizes = [int(x) for x in str(args.tensor_parallel_size).split(",")]
    by_size = {}
    for size in sizes:
        by_size[size] = run_treeserve(path, dtype, prompts, lengths, args, size)
        print(f"treeserve (tensor parallel {size}): {by_size[size]:.1f} s, {useful_tokens / by_size[size]:.1f} output tok/s")
    ours = by_size[sizes[0]]
    peak = max(peak, matmul_peak_tflops(dtype, device))  # shared machines drift: keep the best reading
    result = {"dtype": str(dtype), "device": str(device), "peak_tflops": peak, "treeserve_s": ours,
              "treeserve_tok_s": useful_tokens / ours, "treeserve_mfu": flops / ours / (peak * 1e12),
              "by_tensor_parallel_size": {size: useful_tokens / s for size, s in by_size.items()}}
    for size in sizes[1:]:
        print(f"tensor parallel {size} / {sizes[0]}: {by_size[sizes[0]] / by_size[size]:.2f}x")
    if not args.skip_hf:
        hf_times = {}
        for size in (int(x) for x in args.hf_batch_sizes.split(",")):
            hf_times[size] = run_hf(path, dtype, prompts, lengths, size, device)
            print(f"HF transformers (static batches of {size}): {hf_times[size]:.1f} s, "
                  f"{useful_tokens / hf_times[size]:.1f} output tok/s")
        best_size = min(hf_times, key=hf_times.get)
        hf = hf_times[best_size]
        peak = max(peak, matmul_peak_tflops(dtype, device))
        result.update(hf_s=hf, hf_tok_s=useful_tokens / hf, hf_mfu=flops / hf / (peak * 1e12), ratio=hf / ours)
        print(f"ratio treeserve / best HF (batch {best_size}): {hf / ours:.2f}x")
    result["peak_tflops"] = peak
    result["treeserve_mfu"] = flops / ours / (peak * 1e12)
    print(f"matmul peak used for MFU (best reading): {peak:.3f} TFLOP/s")
    print(f"MFU treeserve: {100 * result['treeserve_mfu']:.1f}%"
          + (f", HF: {100 * flops / result['hf_s'] / (peak * 1e12):.1f}%" if "hf_s" in result else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
