"""Where a founding-search run's time goes, per model: one more run of the shared arena and of the
best static split under PyTorch's profiler, after the timed rounds (`gpu.py --founding-profile`).

The timed rounds say the shared arena computes fewer PRM tokens than the best split and still runs
slower (session 79, H200: 118.6k PRM tokens against 129.0k, 9.4-10.2 s against 8.9-10.0 s); per-model
step times there count the time since the other model's step, so they cannot say whether the
difference is device work (the PRM's 4-token pages in the shared arena, the generator's recomputed
prefixes) or the host's. Here each engine's `step()` runs inside a profiler range named after its
model, so per model: the host time of its steps, the device time of the kernels they launched (CUDA
graph replays included), and the steps' count; over the run: wall time, all kernels' time, and the
ten costliest kernels. Profiled runs are slower than timed ones and are not counted in the rounds.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

RANGE = "engine step: "
TOP_KERNELS = 10


@contextlib.contextmanager
def model_ranges(engines: dict):
    """Each engine's `step()` inside a profiler range named after its model, for the block's length."""
    for name, engine in engines.items():
        engine.step = _in_range(engine.step, RANGE + name)
    try:
        yield
    finally:
        for engine in engines.values():
            del engine.step  # the class's method again


def _in_range(step: Callable, label: str) -> Callable:
    def ranged_step(*args, **kwargs):
        with record_function(label):
            return step(*args, **kwargs)
    return ranged_step


def activities(device: str) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])


def profiled_run(run: Callable[[], dict], engines: dict, device: str) -> dict:
    """`run()` (one search, returning its row) profiled; the row with the profile's figures added."""
    with model_ranges(engines), profile(activities=activities(device)) as prof:
        row = run()
    row["profile"] = figures(prof.key_averages(), prof.events())
    return row


def figures(averages, events) -> dict:
    """Per model: its steps, their host seconds and the device seconds of what they launched; all
    kernels' device seconds and the costliest kernels."""
    per_model = {}
    for avg in averages:
        if avg.key.startswith(RANGE):
            per_model[avg.key[len(RANGE):]] = {"steps": avg.count, "host_s": round(avg.cpu_time_total / 1e6, 4),
                                               "device_s": round(_device_us(avg) / 1e6, 4)}
    kernels = [avg for avg in averages if _is_kernel(avg)]
    kernels.sort(key=_self_device_us, reverse=True)
    return {"per_model": per_model,
            "kernels_s": round(sum(_self_device_us(k) for k in kernels) / 1e6, 4),
            "top_kernels": [[k.key[:80], k.count, round(_self_device_us(k) / 1e6, 4)] for k in kernels[:TOP_KERNELS]]}


def _device_us(avg) -> float:
    return getattr(avg, "device_time_total", 0.0) or 0.0


def _self_device_us(avg) -> float:
    return getattr(avg, "self_device_time_total", 0.0) or 0.0


def _is_kernel(avg) -> bool:
    kind = getattr(avg, "device_type", None)
    return kind is not None and kind != torch.autograd.DeviceType.CPU and _self_device_us(avg) > 0


def describe(label: str, row: dict) -> str:
    profile_ = row["profile"]
    models = ", ".join(f"{m}: {v['steps']} steps, host {v['host_s']:.2f} s, device {v['device_s']:.2f} s"
                       for m, v in profile_["per_model"].items())
    return (f"  profiled {label}: {row['seconds']:.1f} s wall, kernels {profile_['kernels_s']:.2f} s; {models}\n"
            + "\n".join(f"    {name}: {count} launches, {seconds:.3f} s" for name, count, seconds in profile_["top_kernels"]))
