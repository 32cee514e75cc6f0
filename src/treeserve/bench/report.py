"""report.md and the plots of a run directory; side-by-side comparison of several runs."""
from __future__ import annotations

import json
from pathlib import Path

from treeserve import jsonl
from treeserve.bench import plots
from treeserve.bench.client import RequestRecord
from treeserve.bench.telemetry import read_csv

PLOTS = {"throughput_over_time.png": "Throughput over time", "kv_cache_and_queue.png": "KV cache and queue over time",
         "latency_vs_load.png": "TTFT and TPOT against load", "saturation.png": "Saturation point"}


def load_run(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no summary.json (not a benchmark run directory)")
    run = {"summary": json.loads((run_dir / "summary.json").read_text()),
           "config": json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {},
           "records": [], "telemetry": []}
    if (run_dir / "requests.jsonl").is_file():
        run["records"] = [RequestRecord.from_json(row) for row in jsonl.loads((run_dir / "requests.jsonl").read_text())]
    if (run_dir / "telemetry.csv").is_file():
        run["telemetry"] = read_csv(run_dir / "telemetry.csv")[1]
    return run


def write_report(run_dir: Path) -> Path:
    """Draws the plots and writes report.md into `run_dir`; returns the report's path."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    summary, levels = run["summary"], run["summary"]["levels"]
    axis = summary["axis"]
    plots.plot_throughput_over_time(run["records"], run["telemetry"], levels, axis,
                                    run_dir / "throughput_over_time.png")
    plots.plot_kv_and_queue(run["telemetry"], levels, axis, run_dir / "kv_cache_and_queue.png")
    plots.plot_latency_vs_load(levels, axis, run_dir / "latency_vs_load.png")
    plots.plot_saturation(levels, axis, summary.get("saturation"), run_dir / "saturation.png")
    path = run_dir / "report.md"
    path.write_text(render_report(run_dir.name, run))
    return path


def render_report(name: str, run: dict) -> str:
    summary, config = run["summary"], run["config"]
    axis = summary["axis"]
    lines = [f"# Benchmark: {name}", "",
             f"Model `{summary['model']}` at {summary['base_url']}; dataset `{config.get('dataset')}`, "
             f"endpoint `{config.get('endpoint')}`, streaming {config.get('stream')}, seed {config.get('seed')}, "
             f"{config.get('num_requests')} requests per level, {config.get('warmup')} warm-up.", ""]
    lines += level_table(summary["levels"], axis)
    lines += ["", "Tokens/s per request by output length (mean of output tokens / e2e latency):", ""]
    lines += bin_table(summary["levels"], axis)
    saturation = summary.get("saturation")
    if saturation and saturation.get("reached", True):
        lines += ["", f"**Saturation point:** {axis} = {saturation.get(axis)}, the first level reaching "
                      f"{saturation['fraction_of_best']:.0%} of the best output throughput "
                      f"({fmt(saturation['output_throughput'])} tokens/s)."]
    elif saturation:
        lines += ["", f"**Saturation point:** not reached; output throughput was still rising at the highest "
                      f"level ({axis} = {saturation.get(axis)}, {fmt(saturation['output_throughput'])} tokens/s)."]
    telemetry = summary.get("telemetry", {})
    lines += ["", f"Telemetry: {telemetry.get('rows')} scrapes every {telemetry.get('interval_s')} s "
                  f"({telemetry.get('failed_scrapes')} failed), in telemetry.csv.", ""]
    lines += [f"![{title}]({file})" for file, title in PLOTS.items()]
    return "\n".join(lines) + "\n"


def render_level_line(level: dict, axis: str) -> str:
    """One level in a line, for the terminal."""
    return (f"{axis}={level.get(axis)}: {level['completed']}/{level['requests']} ok, "
            f"{fmt(level['request_throughput'])} req/s, {fmt(level['output_throughput'])} out tok/s, "
            f"TTFT p50 {fmt(level['ttft_ms']['median'])} ms, TPOT p50 {fmt(level['tpot_ms']['median'])} ms, "
            f"E2EL p50 {fmt(level['e2el_ms']['median'])} ms"
            + (f", goodput {fmt(level['goodput'])} req/s" if "goodput" in level else "")
            + (f", speculation: {level['spec_decode']['acceptance_rate']:.0%} of draft tokens accepted, "
               f"{fmt(level['spec_decode']['acceptance_length'])} tokens per verified draft"
               if level.get("spec_decode", {}).get("acceptance_rate") is not None else "")
            + _request_acceptance(level) + _failures(level))


def _failures(level: dict) -> str:
    """Why requests failed, where some did (the full list of distinct errors is in summary.json)."""
    if not level.get("failed"):
        return ""
    first = (level.get("errors") or ["?"])[0].replace("\n", " ")
    return f"; {level['failed']} failed, e.g. {first[:160]}"


def _request_acceptance(level: dict) -> str:
    rates = level.get("spec_decode", {}).get("request_acceptance_rate")
    if not rates:
        return ""
    return (f", per request p10/p50/p90 {rates['p10']:.0%}/{rates['median']:.0%}/{rates['p90']:.0%} "
            f"of its draft tokens accepted")


def level_table(levels: list[dict], axis: str) -> list[str]:
    header = [axis, "done/failed", "req/s", "out tok/s", "total tok/s", "goodput req/s", "TTFT mean/p50/p99 ms",
              "TPOT mean/p50/p99 ms", "ITL p50/p99 ms", "E2EL p50/p99 ms", "queue ms (server)", "client lag p99 ms"]
    rows = []
    for level in levels:
        lag = (level.get("client") or {}).get("event_loop_lag_ms") or {}
        rows.append([level.get(axis), f"{level['completed']}/{level['failed']}", fmt(level["request_throughput"]),
                     fmt(level["output_throughput"]), fmt(level["total_token_throughput"]), fmt(level.get("goodput")),
                     stats(level["ttft_ms"], "mean", "median", "p99"), stats(level["tpot_ms"], "mean", "median", "p99"),
                     stats(level["itl_ms"], "median", "p99"), stats(level["e2el_ms"], "median", "p99"),
                     fmt(level.get("queue_time_ms")), fmt(lag.get("p99"))])
    return markdown_table(header, rows)


def bin_table(levels: list[dict], axis: str) -> list[str]:
    names = list(levels[0]["output_len_bins"]) if levels else []
    rows = [[level.get(axis)] + [f"{fmt(level['output_len_bins'][b]['mean_tokens_per_s'])} "
                                 f"({level['output_len_bins'][b]['requests']})" for b in names] for level in levels]
    return markdown_table([axis] + [f"{b} tokens (requests)" for b in names], rows)


def compare_runs(run_dirs: list[Path], out: Path) -> Path:
    """A side-by-side report of several runs: one table per figure, one column per run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = unique_names({Path(d): load_run(Path(d))["summary"] for d in run_dirs})
    plots.plot_comparison(runs, out / "comparison.png")
    lines = ["# Benchmark comparison", "", "Runs: " + ", ".join(f"`{name}` ({s['model']} at {s['base_url']})"
                                                                for name, s in runs.items()), ""]
    figures = (("output tokens/s", "output_throughput", None), ("requests/s", "request_throughput", None),
               ("goodput req/s", "goodput", None), ("median TTFT (ms)", "ttft_ms", "median"),
               ("p99 TTFT (ms)", "ttft_ms", "p99"), ("median TPOT (ms)", "tpot_ms", "median"),
               ("p99 ITL (ms)", "itl_ms", "p99"), ("median e2e latency (ms)", "e2el_ms", "median"))
    for title, key, stat in figures:
        lines += [f"## {title}", ""] + side_by_side(runs, key, stat) + [""]
    lines.append("![comparison](comparison.png)")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def side_by_side(runs: dict[str, dict], key: str, stat: str | None) -> list[str]:
    """Rows: each run's sweep-axis values; columns: the runs."""
    cells: dict[object, dict[str, str]] = {}
    for name, summary in runs.items():
        for level in summary["levels"]:
            value = level.get(key) if stat is None else (level.get(key) or {}).get(stat)
            cells.setdefault(level.get(summary["axis"]), {})[name] = fmt(value)
    axis = next(iter(runs.values()))["axis"] if runs else "level"
    rows = [[x] + [cells[x].get(name, "") for name in runs] for x in sorted(cells, key=sort_key)]
    return markdown_table([axis] + list(runs), rows)


def unique_names(runs: dict[Path, dict]) -> dict[str, dict]:
    named = {}
    for path, summary in runs.items():
        name = path.name or str(path)
        if name in named:
            name = str(path)
        named[name] = summary
    return named


def sort_key(value):
    return (value is None, value if isinstance(value, (int, float)) else str(value))


def stats(dist: dict, *keys: str) -> str:
    return "/".join(fmt(dist.get(k)) for k in keys)


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def markdown_table(header: list, rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]
