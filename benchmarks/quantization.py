"""Quantized weights on this CPU: decode tokens/s at batch 1, 16 and 64 and a 2k-token prefill, for the
weights as stored, int8 weight-only made at load (`quantization="int8"`), and quantized checkpoints
of the same shape (`gptq-w4a16`: GPTQ 4-bit in groups of 128; `gptq-w4a16-head`: the same with its
LM head quantized too, GPTQModel's `lm_head=True`, untied; `ct-w8a8`: compressed-tensors int8
weights and per-token int8 activations), on a Llama-3.2-1B-shaped model with random weights (each
checkpoint written once into the model cache, a bfloat16 one for the first two arms), each arm in a
fresh process, alternating, `--pairs` times; peak RSS of each. Prints medians and each arm / stored
ratio. `--memory`: each arm's load alone (a 64 MiB KV arena), the RSS and the anonymous memory it
added at its peak and once loaded, its weights' bytes in memory (a mapped embedding's file pages
aside) and the load's time.

Decode tokens/s: (the job's time - the same prompts' prefill alone) over the tokens after the first.

    python benchmarks/quantization.py [--pairs 2] [--dtype auto] [--output-tokens 32]
        [--arms stored int8 gptq-w4a16 gptq-w4a16-head ct-w8a8] [--batches 1 16 64] [--prompt-tokens 256] [--prefill-tokens 2000]
    python benchmarks/quantization.py --interleaved 8 [--arms ...] [--batches 1 16]   # every arm in one
                                                  # process, alternating: ratios on a noisy host
    python benchmarks/quantization.py --memory [--arms ...]   # each arm's load alone: the RSS it adds
    python benchmarks/quantization.py --kernels   # one projection's forward: int8 kernel, dequantized
                                                  # GEMM and the stored layer, by rows (picks
                                                  # model/quantization/int8.py's and int4.py's DEQUANTIZE_FROM_ROWS)
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

ARMS = {"stored": None, "int8": "int8", "gptq-w4a16": "gptq", "gptq-w4a16-head": "gptq", "ct-w8a8": "compressed-tensors"}
CHECKPOINT_ARMS = ("gptq-w4a16", "gptq-w4a16-head", "ct-w8a8")
# the checkpoint each arm loads: the float arms a bfloat16 file of the shape (as a user's model is
# read, so that its load's memory is a real one's, not a random initialisation's)
FILES = {"stored": "bfloat16", "int8": "bfloat16"}
BATCHES = (1, 16, 64)
PROMPT_TOKENS = 256
PREFILL_TOKENS = 2000
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def model_path() -> Path:
    from gpu_models import LLAMA_3_2_1B, model_dir
    from treeserve.model.registry import cache_dir

    return model_dir(cache_dir() / "bench-models", "llama-3.2-1b-shape", LLAMA_3_2_1B, 2048)


def checkpoint_path(arm: str) -> Path:
    """A random checkpoint of the model's shape quantized as `arm` says, written once."""
    import shutil

    import torch
    from safetensors.torch import save_file

    base = model_path()
    path = base.parent / f"{base.name}-{arm}"
    if (path / "model.safetensors").is_file():
        return path
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base, path)
    config = json.loads((path / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=generator,
                                                        dtype=torch.bfloat16) * 0.02,
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    with torch.device("meta"):
        import transformers
        shapes = {n.removeprefix("model.").rsplit(".", 1)[0]: tuple(p.shape) for n, p in
                  transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base))
                  .named_parameters() if n.startswith("model.layers.0.")}
    for layer in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for projection in PROJECTIONS:
            out_features, in_features = shapes[f"layers.0.{projection}"]
            tensors.update(_quantized_tensors(arm, f"model.layers.{layer}.{projection}", out_features, in_features,
                                              generator))
    if arm == "gptq-w4a16-head":  # GPTQModel's lm_head=True: the head its own matrix, quantized too
        config["tie_word_embeddings"] = False
        tensors.update(_quantized_tensors(arm, "lm_head", config["vocab_size"], hidden, generator))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if arm != "bfloat16":
        config["quantization_config"] = _quantization_config(arm)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _quantized_tensors(arm: str, prefix: str, out_features: int, in_features: int, generator) -> dict:
    import torch

    if arm == "bfloat16":
        return {f"{prefix}.weight": torch.randn(out_features, in_features, generator=generator,
                                                dtype=torch.bfloat16) * 0.02}
    if arm.startswith("gptq-w4a16"):  # random nibbles, symmetric (zero 8, stored minus one: 7 in every nibble)
        groups = in_features // 128
        return {f"{prefix}.qweight": torch.randint(-2**31, 2**31 - 1, (in_features // 8, out_features),
                                                   generator=generator, dtype=torch.int32),
                f"{prefix}.qzeros": torch.full((groups, out_features // 8), 0x77777777, dtype=torch.int32),
                f"{prefix}.scales": torch.full((groups, out_features), 0.003, dtype=torch.float16),
                f"{prefix}.g_idx": torch.arange(in_features, dtype=torch.int32) // 128}
    return {f"{prefix}.weight": torch.randint(-127, 128, (out_features, in_features), generator=generator,
                                              dtype=torch.int8),
            f"{prefix}.weight_scale": torch.full((out_features, 1), 0.0002, dtype=torch.bfloat16)}


def _quantization_config(arm: str) -> dict:
    if arm.startswith("gptq-w4a16"):
        return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq", "lm_head": arm == "gptq-w4a16-head"}
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
                                          "input_activations": {**int8, "strategy": "token", "dynamic": True}}}}


def _status_bytes(field: str) -> int:
    """/proc/self/status's `field` (VmHWM: the peak RSS, VmRSS: now) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


def _load(arm: str, dtype: str, kv_cache_memory_bytes: int = 1 << 30):
    from treeserve import LLM

    return LLM(str(checkpoint_path(FILES.get(arm, arm))), dtype=dtype, device="cpu", quantization=ARMS[arm],
               max_model_len=2048, enable_prefix_caching=False, max_num_seqs=64,
               kv_cache_memory_bytes=kv_cache_memory_bytes)


def _timed_run(llm, prompts: list[list[int]], tokens: int) -> float:
    from treeserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _decode_rate(llm, rng: random.Random, batch: int, prompt_tokens: int, output_tokens: int) -> float:
    """Decode tokens/s: (the job's time - the same prompts' prefill alone) over the tokens after the first."""
    prompts = [[rng.randrange(10, 30000) for _ in range(prompt_tokens)] for _ in range(batch)]
    prefill = _timed_run(llm, prompts, 1)
    whole = _timed_run(llm, prompts, output_tokens)
    return batch * (output_tokens - 1) / (whole - prefill)


def child(arm: str, dtype: str, output_tokens: int, batches: list[int], prompt_tokens: int,
          prefill_tokens: int) -> dict:
    llm = _load(arm, dtype)
    rng = random.Random(0)
    _timed_run(llm, [[rng.randrange(10, 30000) for _ in range(64)]], 4)  # warm-up
    result = {"arm": arm, "dtype": str(llm.engine.dtype), "decode_tok_s": {}, "prefill_tok_s": 0.0}
    for batch in batches:
        result["decode_tok_s"][batch] = _decode_rate(llm, rng, batch, prompt_tokens, output_tokens)
    if prefill_tokens:
        long_prompt = [[rng.randrange(10, 30000) for _ in range(prefill_tokens)]]
        result["prefill_tok_s"] = prefill_tokens / _timed_run(llm, long_prompt, 1)
    result["peak_rss"] = _peak_rss()
    return result


def kernels() -> None:
    import torch
    from torch import nn

    from treeserve.config import cpu_has_fast_bf16
    from treeserve.model import cpu_kernels, linear_kernels
    from treeserve.model.packed_linear import pack_linears
    from treeserve.model.quantization import Int8Linear
    from treeserve.model.quantization.int4 import Int4Linear
    from treeserve.model.quantization.weights import IntWeight

    dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    for shape in ((2048, 8192), (8192, 2048)):
        stored = nn.Sequential(nn.Linear(*shape, bias=False).to(dtype))
        quantized = Int8Linear(stored[0], pack=False)  # row-major: the kernels below read it as it is
        packed = Int8Linear(stored[0])  # bfloat16 on an AVX512-BF16 + VNNI CPU: the packed kernel's layout
        groups = (shape[1], shape[0] // 128)
        int4 = Int4Linear(IntWeight(torch.randint(0, 16, shape[::-1], dtype=torch.uint8), torch.rand(groups) * 0.01,
                                    torch.full(groups, 8.0), 4, 128), None, torch.bfloat16)
        pack_linears(stored, dtype, torch.device("cpu"))
        for rows in (1, 4, 16, 32, 64, 128, 256, 1024):
            x = torch.randn(rows, shape[0], dtype=dtype)
            timings = {"int8 packed (ours)": lambda: packed(x),
                       "int8 row-major (ours)": lambda: linear_kernels.int8_linear(cpu_kernels.load(), x,
                                                                                quantized.weight, quantized.scales),
                       "int8 (aten)": lambda: torch.ops.aten._weight_int8pack_mm(x, quantized.weight,
                                                                                 quantized.scales.to(dtype)),
                       "dequantized GEMM": lambda: nn.functional.linear(x, quantized.dequantized(dtype)),
                       "int4 (aten)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                           x.bfloat16(), int4.weight, int4.group_size, int4.scales_and_zeros),
                       "int4 dequantized GEMM": lambda: nn.functional.linear(x.bfloat16(),
                                                                             int4.dequantized(torch.bfloat16)),
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


def memory_probe(arm: str, dtype: str) -> dict:
    """What loading `arm` adds to the process's memory (a 64 MiB KV arena): its RSS at the peak (VmHWM)
    and once loaded, and its anonymous memory (RssAnon, sampled every 2 ms while loading) at the peak
    and once loaded. RSS counts the checkpoint file's pages while safetensors has it mapped: clean
    file pages the kernel can drop under pressure; anonymous memory is what has to fit in RAM."""
    import threading

    import treeserve.entrypoints.llm  # noqa: F401  (its imports' memory is the process's, not the load's)

    before, anon_before = _status_bytes("VmRSS"), _status_bytes("RssAnon")
    peak_anon, done = [anon_before], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], _status_bytes("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    llm = _load(arm, dtype, 64 << 20)
    load_s = time.perf_counter() - start
    done.set()
    sampler.join()
    anon = _status_bytes("RssAnon")
    return {"arm": arm, "load_peak": _peak_rss() - before, "held": _status_bytes("VmRSS") - before,
            "anon_peak": max(peak_anon[0], anon) - anon_before, "anon_held": anon - anon_before,
            "weights": _weights_in_memory(llm.engine.model), "load_s": load_s}


def _weights_in_memory(model) -> int:
    """Bytes of the model's tensors (parameters, buffers, tensors its modules hold) in the process's
    own memory: each storage once, those over a file's pages (a mapped embedding) left out."""
    import torch

    files = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[5].startswith("/"):
            files.append(tuple(int(x, 16) for x in fields[0].split("-")))
    storages = {}
    for module in model.modules():
        for value in list(module._parameters.values()) + list(module._buffers.values()) + list(vars(module).values()):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(size for address, size in storages.items() if not any(a <= address < b for a, b in files))


def interleaved(arms: list[str], dtype: str, rounds: int, batches: list[int], prompt_tokens: int,
                output_tokens: int) -> None:
    """Every arm loaded in this one process, their decode runs alternating, `rounds` times: each
    round's ratios to the first arm are taken within seconds of each other, so a machine whose memory
    bandwidth moves between minutes (a shared host's) moves both sides of a ratio alike. Prints each
    round and the medians of the ratios."""
    llms = {arm: _load(arm, dtype, 256 << 20) for arm in arms}
    rng = random.Random(0)
    for llm in llms.values():
        _timed_run(llm, [[rng.randrange(10, 30000) for _ in range(64)]], 4)  # warm-up
    ratios: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds):
        for batch in batches:
            order = arms if round_ % 2 == 0 else list(reversed(arms))
            rates = {arm: _decode_rate(llms[arm], rng, batch, prompt_tokens, output_tokens) for arm in order}
            for arm in arms[1:]:
                ratios.setdefault((arm, batch), []).append(rates[arm] / rates[arms[0]])
            print(f"round {round_ + 1} batch {batch}: " + ", ".join(f"{arm} {rates[arm]:.1f}" for arm in arms)
                  + " tok/s", flush=True)
    for (arm, batch), values in ratios.items():
        print(f"decode batch {batch}: {arm} / {arms[0]} median {statistics.median(values):.2f}x "
              f"(rounds: {', '.join(f'{v:.2f}' for v in values)})")


def memory(arms: list[str], dtype: str) -> None:
    for arm in arms:
        checkpoint_path(FILES.get(arm, arm))
    probes = {}
    for arm in arms:
        out = subprocess.run([sys.executable, __file__, "--memory-child", arm, "--dtype", dtype],
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{arm}: {out.stderr[-2000:]}")
        probes[arm] = json.loads(out.stdout.strip().splitlines()[-1])
        probe = probes[arm]
        print(f"{arm}: load adds RSS {probe['load_peak'] / 2**30:.2f} GiB at its peak, {probe['held'] / 2**30:.2f} "
              f"once loaded; anonymous {probe['anon_peak'] / 2**30:.2f} at its peak, "
              f"{probe['anon_held'] / 2**30:.2f} once loaded; its weights {probe['weights'] / 2**30:.2f} in memory; "
              f"loaded in {probe['load_s']:.1f} s", flush=True)
    base = probes[arms[0]]
    for arm in arms[1:]:
        print(f"{arm} / {arms[0]}: " + ", ".join(f"{key} {probes[arm][key] / base[key]:.2f}x" for key in
                                                 ("load_peak", "held", "anon_peak", "anon_held", "weights")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="0: no prefill measurement")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--child", choices=list(ARMS))
    parser.add_argument("--memory", action="store_true", help="each arm's load alone: the RSS it adds")
    parser.add_argument("--memory-child", choices=list(ARMS))
    parser.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                        help="every arm in one process, decode runs alternating ROUNDS times (no RSS, no prefill)")
    args = parser.parse_args()
    if args.kernels:
        kernels()
        return 0
    if args.memory_child:
        print(json.dumps(memory_probe(args.memory_child, args.dtype)))
        return 0
    if args.memory:
        memory(args.arms, args.dtype)
        return 0
    if args.interleaved:
        for arm in args.arms:
            checkpoint_path(FILES.get(arm, arm))
        interleaved(args.arms, args.dtype, args.interleaved, args.batches, args.prompt_tokens, args.output_tokens)
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.dtype, args.output_tokens, args.batches, args.prompt_tokens,
                               args.prefill_tokens)))
        return 0
    for arm in args.arms:  # written once, before any timing
        checkpoint_path(FILES.get(arm, arm))
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for pair in range(args.pairs):
        for arm in (args.arms if pair % 2 == 0 else list(reversed(args.arms))):
            command = [sys.executable, __file__, "--child", arm, "--dtype", args.dtype, "--output-tokens",
                       str(args.output_tokens), "--batches", *map(str, args.batches), "--prompt-tokens",
                       str(args.prompt_tokens), "--prefill-tokens", str(args.prefill_tokens)]
            out = subprocess.run(command, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{arm}: {out.stderr[-2000:]}")
            results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = results[arm][-1]
            print(f"pair {pair + 1} {arm} ({r['dtype']}): decode " + ", ".join(
                f"b{b} {v:.1f}" for b, v in r["decode_tok_s"].items()) + f" tok/s; prefill {r['prefill_tok_s']:.0f} "
                f"tok/s; peak RSS {r['peak_rss'] / 2**30:.2f} GiB", flush=True)
    median = {arm: {str(b): statistics.median(r["decode_tok_s"][str(b)] for r in rows) for b in args.batches}
              | {"prefill": statistics.median(r["prefill_tok_s"] for r in rows),
                 "peak_rss": statistics.median(r["peak_rss"] for r in rows)} for arm, rows in results.items()}
    print("\nmedians:", json.dumps(median))
    base = args.arms[0]
    for arm in args.arms[1:]:
        for key in [str(b) for b in args.batches] + (["prefill"] if args.prefill_tokens else []) + ["peak_rss"]:
            labels = {"prefill": f"prefill {args.prefill_tokens} tokens", "peak_rss": "peak RSS"}
            label = labels.get(key, f"decode batch {key}")
            print(f"{label}: {arm} / {base} {median[arm][key] / median[base][key]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
