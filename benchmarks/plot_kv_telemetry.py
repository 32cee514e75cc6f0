"""The study's figures from a memory-split run directory (summary.json + per-step traces).

    python benchmarks/plot_kv_telemetry.py bench_out/memory_split
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def plot_all(run_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    static, shared = summary["static"], summary["shared"]
    splits = [r["split"] for r in static]
    models = sorted(shared["hit_rate"])
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(splits, [r["problems_per_s"] for r in static], "o-", label="static split")
    ax.axhline(shared["problems_per_s"], color="tab:red", linestyle="--", label="shared arena")
    if summary.get("unconstrained"):
        ax.axhline(summary["unconstrained"]["problems_per_s"], color="tab:gray", linestyle=":",
                   label="unconstrained (ceiling)")
    ax.set(xlabel="KV fraction given to the generator", ylabel="problems / s", title="Throughput against memory split")
    ax.legend()
    written.append(_save(fig, run_dir / "throughput_vs_split.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    trace = _read_trace(run_dir / shared["trace"])
    for model in models:
        rows = [r for r in trace if r["model"] == model]
        ax.plot(range(len(rows)), [r["blocks_in_use"] for r in rows], label=f"{model} in use")
        ax.plot(range(len(rows)), [r["blocks_cached"] for r in rows], ":", label=f"{model} cached")
    ax.set(xlabel="engine step (per model)", ylabel="KV pages", title="Blocks per step, shared arena")
    ax.legend()
    written.append(_save(fig, run_dir / "blocks_per_step.png"))

    for key, label, name in (("hit_rate", "prefix-cache hit rate", "hit_rate_vs_split.png"),
                             ("thrash", "thrash events", "thrash_vs_split.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for model in models:
            line, = ax.plot(splits, [r[key][model] for r in static], "o-", label=f"{model} (static)")
            ax.axhline(shared[key][model], color=line.get_color(), linestyle="--", label=f"{model} (shared)")
        ax.set(xlabel="KV fraction given to the generator", ylabel=label, title=f"{label} against memory split")
        ax.legend()
        written.append(_save(fig, run_dir / name))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    for written_path in plot_all(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out/memory_split")):
        print(written_path)
