"""The GPU check in one command (about 8 minutes on one H100 or H200), with only what that machine has.

    PYTHONPATH=src python3 benchmarks/gpu.py --out $OUT      # on the GPU machine (no install needed)
    python benchmarks/gpu.py --smoke --device cpu            # here: tiny shapes, every code path

Sections, each timed and reported even when another fails (the JSON is rewritten after each):
1. tests: the CUDA tests (tests/test_cuda.py, the Triton kernel and parity tests compiled on the
   device, the HF parity tests on cuda).
2. offline: a random Llama-3.2-1B-shaped model in bfloat16, 256 requests (prompts 64-1,024 tokens,
   outputs 64-512, EOS ignored): treeserve's output tok/s against HF transformers' continuous
   batching (`generate_batch`'s manager, SDPA, its CUDA graphs asked for) and HF static batching
   (batches of 64), all in this run.
3. decode: one decode step's time at batch 1, 8, 64 and 256 (context ~1k) against the bound
   (weight bytes + KV bytes read) / (device-to-device copy bandwidth measured in this run).
4. bundled search: the bundled arith-gen/arith-prm pair's beam search (N=16), problems/s on the GPU
   and on this machine's CPU.
5. founding search (benchmarks/gpu_founding.py): the founding study's experiment, a
   Llama-3.2-1B-shaped generator and a Llama-3.1-8B-shaped PRM in a KV budget that binds, beam
   search N=16 over MATH-500-shaped questions with static generator/PRM splits 0.08-0.5, in
   the shared arena and unconstrained (3x the budget: the ceiling of any memory policy), warmed
   up, alternated, 3 rounds, medians. `--founding-replica --device cpu --sections founding_search`
   runs it on a CPU at the device's page counts (tiny models, the same KV arithmetic).
   `--founding-profile` adds one profiled run of the shared arena and of the best split: host and
   device seconds per model, the costliest kernels (benchmarks/gpu_founding_profile.py).
Sections run on request only: `spec_search` (benchmarks/gpu_spec_search.py: the bundled beam
search with and without sibling suffix speculation, issue #57's 1.4x, alternating), `decode_baseline` (the decode section with PyTorch's unfused
per-layer ops, for an A/B in one run), `decode_rotary_apart` (the decode section with the rotary and
the K/V write as two launches a layer, `TREESERVE_FUSED_ROTARY_KV=0`'s path, for an A/B of their
fusion in one run), `decode_sync` (the decode section without async scheduling:
each step's tokens reach the host before the next step is scheduled) and `attention` (benchmarks/gpu_attention.py's sweep; its
chosen split policy holds for the sections after it). `--no-peers` skips HF in `offline` (`--peers` picks);
`--models DIR` puts the random models' folders outside OUT (OUT keeps only a few files).
Prints one table (figure, treeserve, peer or bound, ratio, target) and writes it with every raw
figure to OUT/gpu.json, and the tests' whole output to OUT/tests.log.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_founding  # noqa: E402
import gpu_models as gm  # noqa: E402
import gpu_spec_search  # noqa: E402

from treeserve import LLM, Runtime, SamplingParams  # noqa: E402
from treeserve.engine.tp_worker import resident_bytes  # noqa: E402
from treeserve.search.config import SearchConfig  # noqa: E402
from treeserve.search.runner import SearchRunner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_triton_kernels.py", "tests/test_fused_ops.py", "tests/test_rotary_kv.py",
              "tests/test_triton_parity.py", "tests/test_hf_parity.py", "tests/test_attention_backends.py",
              "tests/test_grouped_experts.py"]


def run_tests(args) -> dict:
    workers = ["-n", str(args.tests_workers)] if args.tests_workers > 1 else []  # Triton compiles in parallel
    command = [sys.executable, "-m", "pytest", "-v", "--durations=15", "-p", "no:cacheprovider", *workers, *CUDA_TESTS]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    start, log = time.perf_counter(), args.out / "tests.log"
    with log.open("w") as sink:  # written as it runs: a timeout keeps what ran (each test's name, -v)
        try:
            returncode = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                        timeout=args.tests_timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    lines = [line for line in log.read_text().strip().splitlines() if "Warning: CUDA warning" not in line]
    tail = [line for line in lines if " FAILED" in line or " ERROR" in line][:20] + lines[-15:]
    print("\n".join(tail))
    return {"returncode": returncode, "seconds": time.perf_counter() - start, "tail": tail}


def offline_workload(count: int, vocab: int, seed: int, smoke: bool):
    rng = random.Random(seed)
    prompt_range, output_range = ((8, 48), (4, 24)) if smoke else ((64, 1024), (64, 512))
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(count)]
    return prompts, [rng.randint(*output_range) for _ in range(count)]


def engine_options(args, **extra) -> dict:
    options = dict(dtype=args.dtype, device=args.device, load_format="dummy", enable_prefix_caching=False,
                   max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    if args.smoke:
        options.update(kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=2048)
    options.update(extra)
    return options


def run_offline(args, generator_dir: Path) -> dict:
    vocab = model_shapes(args)[0][0]["vocab_size"]
    prompts, lengths = offline_workload(args.requests, vocab, 0, args.smoke)
    llm = LLM(str(generator_dir), **engine_options(args))
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"treeserve": {"seconds": seconds, "output_tokens": produced, "tok_s": produced / seconds,
                            "backend": llm.engine.attention_backend, "cuda_graphs": llm.engine.uses_cuda_graphs,
                            "steps": llm.engine.num_steps, "steps_left_running": llm.engine.stats().num_steps_left_running}}
    del llm, outputs
    gm.free_memory(args.device)
    print(f"treeserve: {produced / seconds:,.0f} output tok/s ({seconds:.1f} s)")
    if args.no_peers:
        return result
    device = torch.device(args.device)
    model = gm.hf_model(generator_dir, dtype_of(args), device)
    peers = {"hf_continuous": lambda: gm.hf_continuous(model, prompts, lengths, device.type == "cuda", args.hf_timeout),
             "hf_static": lambda: gm.hf_static(model, prompts, lengths, args.hf_batch, device)}
    for name, run in ((name, peers[name]) for name in args.peers):
        try:
            result[name] = run()
            print(f"{name}: {result[name]['tok_s']:,.0f} output tok/s ({result[name]['seconds']:.1f} s)")
        except Exception as exc:  # a peer's API may differ on the machine's transformers: report, go on
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name} failed: {result[name]['error']}")
    del model
    gm.free_memory(args.device)
    return result


def dtype_of(args) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]


def run_decode(args, generator_dir: Path, **options) -> dict:
    """Median decode-step time at each batch size once every sequence has ~`context` tokens."""
    device = torch.device(args.device)
    bandwidth = gm.copy_bandwidth(device, nbytes=(64 << 20) if args.smoke else (1 << 30))
    llm = LLM(str(generator_dir), **engine_options(args, **options))
    engine = llm.engine
    weight_bytes = resident_bytes(engine.model)
    context = 48 if args.smoke else 1000
    backend = engine.model.backend
    rows = {"copy_bandwidth_bytes_s": bandwidth, "weight_bytes": weight_bytes, "backend": backend.name,
            "fused_rotary_kv": backend.fuses_rotary, "batches": {}}
    for batch in args.decode_batches:
        step_s = _decode_step_seconds(llm, batch, context, args.decode_steps)
        kv_read = batch * (context + args.decode_steps // 2) * engine.kv_bytes_per_token()
        bound = (weight_bytes + kv_read) / bandwidth
        rows["batches"][batch] = {"step_ms": step_s * 1e3, "bound_ms": bound * 1e3, "x_bound": step_s / bound}
        print(f"decode batch {batch}: {step_s * 1e3:.3f} ms/step, bound {bound * 1e3:.3f} ms ({step_s / bound:.2f}x)")
    del llm, engine
    gm.free_memory(args.device)
    return rows


def run_decode_baseline(args, generator_dir: Path) -> dict:
    """The decode section with PyTorch's unfused per-layer operations, for an A/B in one run."""
    return _decode_with_switch(args, generator_dir, "FUSED_OPS")


def run_decode_rotary_apart(args, generator_dir: Path) -> dict:
    """The decode section with the rotary and the K/V write as two launches a layer (the fused
    per-layer ops otherwise on), for an A/B of their fusion in one run."""
    return _decode_with_switch(args, generator_dir, "FUSED_ROTARY_KV")


def _decode_with_switch(args, generator_dir: Path, switch: str) -> dict:
    """`run_decode` with one of `treeserve.model.kernels`' switches off (read as the model is built)."""
    from treeserve.model import kernels
    setattr(kernels, switch, False)
    try:
        return run_decode(args, generator_dir)
    finally:
        setattr(kernels, switch, True)


def run_attention_sweep(args) -> dict:
    """gpu_attention.py's sweep; its chosen split policy and decode tile hold for the sections after."""
    import gpu_attention
    if args.smoke:
        result = gpu_attention.sweep(torch.device("cpu"), batches=(1, 3), context=40, smoke=True)
    else:
        result = gpu_attention.sweep(torch.device(args.device))
    gpu_attention.apply(result["choice"])
    return result


def prefill_batch(llm: LLM, batch: int, context: int, max_tokens: int) -> None:
    """`batch` random prompts of `context` tokens queued and stepped until every one is prefilled."""
    engine, loop, rng = llm.engine, llm.loop, random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started: set[str] = set()  # requests whose first token arrived: their prompt is prefilled
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(context)]
        loop.add_request(engine, f"decode-{batch}-{i}", prompt, params,
                         lambda output: started.add(output.request_id))
    while len(started) < batch and loop.has_unfinished_requests():
        loop.step()


def _decode_step_seconds(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Every sequence prefilled first; then the median of the decode steps (each loop step is one
    engine step, which ends in the one copy of the sampled ids to the host)."""
    loop = llm.loop
    prefill_batch(llm, batch, context, steps + 2)
    times = []
    while loop.has_unfinished_requests():
        start = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - start)
    decode = times[:steps]
    return sorted(decode)[len(decode) // 2]


def run_bundled_search(args) -> dict:
    from treeserve.model.registry import DEFAULT_GENERATOR, DEFAULT_VERIFIER
    from treeserve.search.config import declared_aggregation
    from treeserve.tasks.arithmetic import generate

    problems = [p.text for p in generate("test", args.bundled_problems, seed=0)]
    result = {}
    for device in dict.fromkeys([args.device, "cpu"]):
        rt = Runtime({"gen": DEFAULT_GENERATOR, "prm": DEFAULT_VERIFIER}, device=device,
                     kv_cache_memory_bytes=256 << 20)
        config = SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=8, max_tokens=64, seed=0,
                              agg_strategy=declared_aggregation(rt.engine("prm").model_dir))
        result[device] = timed_search(rt, problems, config, f"bundled beam search on {device}", warm_up=2)
        del rt
        gm.free_memory(args.device)
    return result


def timed_search(rt: Runtime, problems: list[str], config: SearchConfig, label: str, warm_up: int = 0) -> dict:
    """Problems per second of one search over `problems` (after `warm_up` of them); closes `rt`."""
    try:
        runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"))
        if warm_up:
            runner.run(problems[:warm_up], config)
        start = time.perf_counter()
        runner.run(problems, config)
        seconds = time.perf_counter() - start
    finally:
        rt.close()
    print(f"{label}: {len(problems) / seconds:.3f} problems/s")
    return {"problems_s": len(problems) / seconds, "seconds": seconds}


def run_founding_search(args, generator_dir: Path, verifier_dir: Path) -> dict:
    vocab = model_shapes(args)[0][0]["vocab_size"]
    partial = {}

    def write(result: dict) -> None:  # every run lands in gpu.json as it ends (a cut call keeps them)
        partial["founding_search"] = result
        gm.write_json(args.out / "gpu.json", args.results | partial)
    return gpu_founding.run_founding_study(args, {"gen": generator_dir, "prm": verifier_dir}, vocab, write)


def table(results: dict) -> list[list[str]]:
    rows = [["figure", "treeserve", "peer or bound", "ratio", "target"]]
    offline = results.get("offline", {})
    ours = offline.get("treeserve", {}).get("tok_s")
    for peer, target in (("hf_continuous", ">= 2x (goal 4x)"), ("hf_static", ">= 5x")):
        theirs = offline.get(peer, {}).get("tok_s")
        if ours and theirs:
            rows.append([f"offline tok/s vs {peer}", f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}x", target])
    for section, label in (("decode_baseline", "decode step (unfused ops)"), ("decode_sync", "decode step (sync scheduling)"),
                           ("decode_rotary_apart", "decode step (rotary, K/V write apart)"), ("decode", "decode step")):
        for batch, row in results.get(section, {}).get("batches", {}).items():
            target = "<= 1.5x (goal 1.3x)" if int(batch) == 1 else "<= 2x"
            rows.append([f"{label}, batch {batch}", f"{row['step_ms']:.3f} ms", f"{row['bound_ms']:.3f} ms",
                         f"{row['x_bound']:.2f}x bound", target])
    bundled = results.get("bundled_search", {})
    if "cpu" in bundled and len(bundled) > 1:
        gpu = next(v for k, v in bundled.items() if k != "cpu")
        rows.append(["bundled beam search problems/s", f"{gpu['problems_s']:.2f}", f"{bundled['cpu']['problems_s']:.2f} (CPU)",
                     f"{gpu['problems_s'] / bundled['cpu']['problems_s']:.2f}x", "> 1x"])
    rows.extend(gpu_spec_search.table_rows(results.get("spec_search", {})))
    if "summary" in results.get("founding_search", {}):
        rows.extend(gpu_founding.table_rows(results["founding_search"]))
    return rows


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/gpu"))
    parser.add_argument("--models", type=Path, default=None, help="where the random models' folders go (OUT/models)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts: checks the script, not speed")
    parser.add_argument("--sections", default="tests,offline,decode,bundled_search,founding_search")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--no-peers", action="store_true", help="offline: treeserve only (no HF transformers runs)")
    parser.add_argument("--peers", default="hf_continuous,hf_static", help="offline: which HF runs (comma-separated)")
    parser.add_argument("--hf-timeout", type=float, default=240)
    parser.add_argument("--tests-timeout", type=float, default=240)
    parser.add_argument("--tests-workers", type=int, default=4, help="pytest-xdist workers for the tests (1: none)")
    parser.add_argument("--decode-batches", default="1,8,64,256")
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--bundled-problems", type=int, default=32)
    parser.add_argument("--spec-repeats", type=int, default=3, help="spec_search: alternating rounds")
    parser.add_argument("--search-problems", type=int, default=16)
    parser.add_argument("--search-depth", type=int, default=6, help="founding search: beam iterations")
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--splits", default="0.08,0.1,0.2,0.3,0.4,0.5", help="static generator shares of the KV budget")
    parser.add_argument("--founding-kv-gib", type=float, default=4.0, help="the founding search's KV budget "
                        "(benchmarks/gpu_founding.py says why 4 GiB binds)")
    parser.add_argument("--founding-repeats", type=int, default=3)
    parser.add_argument("--founding-seconds", type=float, default=330, help="no new round after this many seconds")
    parser.add_argument("--founding-block-size", type=int, default=64,
                        help="also run the shared arena with pages of this many generator tokens (0: not)")
    parser.add_argument("--founding-max-len", type=int, default=2048)
    parser.add_argument("--founding-ceiling", type=float, default=3, help="also run the founding search unconstrained, "
                        "in this many times the KV budget (the ceiling of any memory policy; 0: not)")
    parser.add_argument("--founding-profile", action="store_true",
                        help="after the rounds, one more run of the shared arena and the best static split under "
                        "PyTorch's profiler: host and device seconds per model, the costliest kernels")
    parser.add_argument("--founding-replica", action="store_true",
                        help="founding_search on a CPU at the device run's page counts: tiny models with the 1B:8B "
                        "KV bytes per token, --founding-kv-gib (the device's budget) scaled to match")
    args = parser.parse_args(argv)
    args.decode_batches = [int(x) for x in args.decode_batches.split(",")]
    args.peers = [name for name in args.peers.split(",") if name]
    if unknown := set(args.peers) - {"hf_continuous", "hf_static"}:
        parser.error(f"--peers: unknown {sorted(unknown)}; choose from hf_continuous, hf_static")
    args.splits = [float(x) for x in args.splits.split(",") if x]
    args.founding_device_kv_gib = args.founding_kv_gib  # the device's budget (a replica's stands for it)
    if args.founding_replica:
        if args.smoke:
            parser.error("--founding-replica runs the device's workload at its page counts; --smoke shrinks it")
        args.dtype = gpu_founding.REPLICA_DTYPE
        args.founding_kv_gib *= gpu_founding.replica_kv_scale()
    if args.smoke:
        args.dtype = "float32"
        args.requests, args.hf_batch, args.decode_steps = min(args.requests, 12), 4, 6
        args.decode_batches = [b for b in args.decode_batches if b <= 8]
        args.bundled_problems, args.search_problems, args.search_depth, args.step_tokens = 4, 2, 2, 8
        args.spec_repeats = 1
        args.splits, args.founding_kv_gib, args.founding_repeats = args.splits[-2:], 1 / 64, 1
        args.founding_max_len, args.founding_block_size = 256, 32
        args.founding_device_kv_gib = args.founding_kv_gib
    return args


def model_shapes(args) -> tuple[tuple[dict, dict], tuple[str, str]]:
    """The generator's and the verifier's shapes and folder names: the 1B and 8B, tiny ones
    (--smoke), or the founding replica's (--founding-replica)."""
    if args.smoke:
        return (gm.TINY, gm.TINY), ("gen-smoke", "prm-smoke")
    if args.founding_replica:
        return gpu_founding.REPLICA_SHAPES, ("gen-replica", "prm-replica")
    return (gm.LLAMA_3_2_1B, gm.LLAMA_3_1_8B), ("llama-3.2-1b-shape", "llama-3.1-8b-shape")


def model_dirs(args, root: Path) -> tuple[Path, Path]:
    shapes, names = model_shapes(args)
    return gm.model_dir(root, names[0], shapes[0], 4096), gm.model_dir(root, names[1], shapes[1], 4096)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    root = args.models or args.out / "models"
    generator_dir, verifier_dir = model_dirs(args, root)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    results: dict = {"device": device, "torch": torch.__version__, "dtype": args.dtype, "smoke": args.smoke}
    args.results = results
    print(f"device: {device}, torch {torch.__version__}")
    sections = {"tests": lambda: run_tests(args), "offline": lambda: run_offline(args, generator_dir),
                "decode": lambda: run_decode(args, generator_dir), "bundled_search": lambda: run_bundled_search(args),
                "decode_baseline": lambda: run_decode_baseline(args, generator_dir),
                "decode_rotary_apart": lambda: run_decode_rotary_apart(args, generator_dir),
                "decode_sync": lambda: run_decode(args, generator_dir, async_scheduling=False),
                "attention": lambda: run_attention_sweep(args),
                "spec_search": lambda: gpu_spec_search.run(args, args.bundled_problems, args.spec_repeats),
                "founding_search": lambda: run_founding_search(args, generator_dir, verifier_dir)}
    for name in args.sections.split(","):
        print(f"== {name} ({time.perf_counter() - started:.0f} s in)", flush=True)
        try:
            results[name] = sections[name]()
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(results[name]["traceback"])
        gm.free_memory(args.device)
        gm.write_json(args.out / "gpu.json", results)
    rows = table(results)
    results["table"] = rows
    results["seconds"] = time.perf_counter() - started
    gm.write_json(args.out / "gpu.json", results)
    print_table(rows)
    print(f"total {results['seconds']:.0f} s; figures in {args.out / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
