"""Where a decode step's time goes on the GPU: device kernel time against the step's wall time, the
top kernels, and the top host-side Python functions (the 1B-shaped model of gpu.py, context ~1k).

    PYTHONPATH=src python3 benchmarks/gpu_profile.py --out $OUT          # on the GPU machine
    python benchmarks/gpu_profile.py --smoke --device cpu                # here: checks the script

Prints, per batch size: wall ms/step (median), device kernel ms/step (sum of kernel times over the
profiled steps / steps), the ten costliest kernels and the fifteen costliest host functions (own time);
writes the full tables under OUT/profile/.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import gpu_models as gm  # noqa: E402
from gpu import engine_options, prefill_batch  # noqa: E402

from treeserve import LLM  # noqa: E402


def wall_ms(llm: LLM, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.loop.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def device_profile(llm: LLM, steps: int, device: torch.device) -> tuple[float, str]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.loop.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernel_us = sum(getattr(e, key, 0) for e in events if e.device_type.name == "CUDA") if device.type == "cuda" else 0
    return kernel_us / 1e3 / steps, events.table(sort_by=key, row_limit=40)


def host_profile(llm: LLM, steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.loop.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def profile_batch(args, model_dir: Path, batch: int) -> dict:
    device = torch.device(args.device)
    llm = LLM(str(model_dir), **engine_options(args))
    try:
        prefill_batch(llm, batch, args.context, 3 * args.steps + 4)
        wall_ms(llm, 2)  # warm
        wall = wall_ms(llm, args.steps)
        kernel_ms, kernels = device_profile(llm, args.steps, device)
        host = host_profile(llm, args.steps)
    finally:
        llm.close()
        del llm
        gm.free_memory(device)
    out = args.out / "profile"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernels_b{batch}.txt").write_text(kernels)
    (out / f"host_b{batch}.txt").write_text(host)
    print(f"== batch {batch}: wall {wall:.3f} ms/step, device kernels {kernel_ms:.3f} ms/step")
    print("\n".join(kernels.splitlines()[:14]))
    print("\n".join(line[:150] for line in host.splitlines() if line.strip())[:3500])
    return {"wall_ms": wall, "kernel_ms": kernel_ms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/gpu"))
    parser.add_argument("--models", type=Path, default=None,
                        help="where the random model's folder goes (OUT/models; gpu.py's --models shares it)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--context", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.smoke:
        args.dtype, args.context, args.steps = "float32", 48, 4
    shape = gm.TINY if args.smoke else gm.LLAMA_3_2_1B
    model_dir = gm.model_dir(args.models or args.out / "models", "gen-smoke" if args.smoke else "llama-3.2-1b-shape", shape, 4096)
    results = {b: profile_batch(args, model_dir, int(b)) for b in args.batches.split(",")}
    gm.write_json(args.out / "profile" / "summary.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
