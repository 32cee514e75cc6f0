"""PNG plots of a run (matplotlib, Agg): throughput over time, KV cache and queue over time,
latency against load, the saturation point; and overlays comparing runs."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from treeserve.bench.client import RequestRecord  # noqa: E402

AXIS_TITLES = {"concurrency": "concurrency (requests in flight)", "request_rate": "request rate (req/s)",
               "input_len": "prompt length (tokens)", "output_len": "output length (tokens)"}
DPI = 90


def series(telemetry: list[dict], suffix: str) -> dict[str, tuple[list[float], list[float]]]:
    """Every telemetry column whose metric name ends with `suffix` (any prefix), as (t, value) lists."""
    found = {}
    for column in (telemetry[0].keys() if telemetry else ()):
        if column.split("{", 1)[0].rsplit(":", 1)[-1] != suffix:
            continue
        points = [(row["t"], row[column]) for row in telemetry if row.get(column) is not None]
        if points:
            found[column] = ([p[0] for p in points], [p[1] for p in points])
    return found


def token_times(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(time, tokens) pairs: each request's output tokens spread over its text chunks (or its end)."""
    times, weights = [], []
    for r in records:
        if not r.success or not r.output_tokens:
            continue
        arrivals = r.chunk_times or [r.end]
        times += arrivals
        weights += [r.output_tokens / len(arrivals)] * len(arrivals)
    return times, weights


def counter_stride(t: list[float], window_s: float = 1.0) -> int:
    """How many samples back a counter's rate is taken from, so that it spans about `window_s`."""
    if len(t) < 2:
        return 1
    step = (t[-1] - t[0]) / (len(t) - 1)
    return max(1, min(len(t) - 1, round(window_s / step) if step > 0 else 1))


def shade_levels(ax, levels: list[dict], axis: str, labels: bool = True) -> None:
    """Each level's span, shaded (and named, on the top panel), on a time axis."""
    for i, level in enumerate(levels):
        if level.get("start") is None or level.get("end") is None:
            continue
        ax.axvspan(level["start"], level["end"], color=f"C{i % 10}", alpha=0.08)
        if labels:
            ax.text(level["start"], 1.01, f"{axis}={level.get(axis)}", transform=ax.get_xaxis_transform(),
                    va="bottom", fontsize=7, rotation=20)


def plot_throughput_over_time(records, telemetry, levels, axis, path: Path) -> None:
    times, weights = token_times(records)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    if times:
        width = max(0.25, (max(times) - min(times)) / 120)
        edges = np.arange(0.0, max(times) + width, width)
        counts, _ = np.histogram(times, bins=edges, weights=weights)
        ax.step(edges[:-1], counts / width, where="post", label="output tokens/s (client)")
    for column, (t, v) in series(telemetry, "generation_tokens_total").items():
        stride = counter_stride(t)
        rate = [(v[i] - v[i - stride]) / (t[i] - t[i - stride]) for i in range(stride, len(t))]
        ax.plot(t[stride:], rate, alpha=0.7, label=f"{short(column)} rate (server)")
    shade_levels(ax, levels, axis)
    ax.set(xlabel="time since start of run (s)", ylabel="output tokens/s")
    fig.suptitle("Throughput over time (shaded: load levels; before them: warm-up)")
    ax.legend(loc="upper left", fontsize=8)
    save(fig, path)


def plot_kv_and_queue(telemetry, levels, axis, path: Path) -> None:
    fig, (kv_ax, queue_ax) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for column, (t, v) in series(telemetry, "kv_cache_usage_perc").items():
        kv_ax.plot(t, [100 * x for x in v], label=short(column))
    for name in ("num_requests_waiting", "num_requests_running"):
        for column, (t, v) in series(telemetry, name).items():
            queue_ax.plot(t, v, label=short(column), drawstyle="steps-post")
    for ax, what in ((kv_ax, "KV cache usage"), (queue_ax, "requests")):
        if not ax.lines:
            ax.text(0.5, 0.5, f"{what}: not reported by this server", ha="center", transform=ax.transAxes)
        else:
            ax.legend(loc="upper right", fontsize=7)
        shade_levels(ax, levels, axis, labels=ax is kv_ax)
    kv_ax.set_ylabel("KV cache usage (%)")
    fig.suptitle("KV cache and queue over time")
    queue_ax.set(xlabel="time since start of run (s)", ylabel="requests")
    save(fig, path)


def plot_latency_vs_load(levels, axis, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = [level.get(axis) for level in levels]
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            y = [level[key][stat] for level in levels]
            if any(v is not None for v in y):
                ax.plot(x, [np.nan if v is None else v for v in y], style, label=stat)
        ax.set(xlabel=AXIS_TITLES.get(axis, axis), ylabel=f"{title} (ms)", title=f"{title} against {axis}")
        log_axis_if_wide(ax, x)
        ax.legend(fontsize=8)
    save(fig, path)


def plot_saturation(levels, axis, saturation: dict | None, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = [level.get(axis) for level in levels]
    ax.plot(x, [level["output_throughput"] or 0 for level in levels], "o-", color="C0")
    ax.set(xlabel=AXIS_TITLES.get(axis, axis), ylabel="output tokens/s", title="Saturation")
    ax.yaxis.label.set_color("C0")
    latency = ax.twinx()
    latency.plot(x, [level["e2el_ms"]["median"] or np.nan for level in levels], "s--", color="C3")
    latency.set_ylabel("median e2e latency (ms)", color="C3")
    if saturation is not None and saturation.get("reached", True):
        ax.axvline(saturation.get(axis), color="grey", linestyle=":")
        ax.text(0.02, 0.96, f"saturation point: {axis} = {saturation.get(axis)}\n(first level at "
                f"{saturation['fraction_of_best']:.0%} of the best throughput)", transform=ax.transAxes,
                va="top", fontsize=8)
    elif saturation is not None:
        ax.text(0.02, 0.96, "saturation not reached: throughput still rising at the highest level",
                transform=ax.transAxes, va="top", fontsize=8)
    log_axis_if_wide(ax, x)
    save(fig, path)


def plot_comparison(runs: dict[str, dict], path: Path) -> None:
    """Output throughput, median TTFT and median TPOT against each run's sweep axis, one line per run."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (("output_throughput", None, "output tokens/s"), ("ttft_ms", "median", "median TTFT (ms)"),
              ("tpot_ms", "median", "median TPOT (ms)"))
    every_x = []
    for name, summary in runs.items():
        x = [level.get(summary["axis"]) for level in summary["levels"]]
        every_x += x
        for ax, (key, stat, label) in zip(axes, panels):
            y = [level[key][stat] if stat else level[key] for level in summary["levels"]]
            ax.plot(x, [np.nan if v is None else v for v in y], "o-", label=name)
            ax.set(xlabel=AXIS_TITLES.get(summary["axis"], summary["axis"]), ylabel=label)
    for ax in axes:
        log_axis_if_wide(ax, every_x)
    axes[0].legend(fontsize=8)
    fig.suptitle("Runs compared")
    save(fig, path)


def log_axis_if_wide(ax, x) -> None:
    """Log scale when the values span 8x or more, ticks at the values themselves."""
    numbers = sorted({v for v in x if isinstance(v, (int, float)) and v > 0})
    if len(numbers) > 1 and numbers[-1] / numbers[0] >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(numbers, [f"{v:g}" for v in numbers])
        ax.minorticks_off()


def short(column: str) -> str:
    return column.split("{", 1)[0].rsplit(":", 1)[-1] + (" " + column[column.index("{"):] if "{" in column else "")


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
