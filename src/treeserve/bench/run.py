"""One benchmark run against a live server: warm-up, the levels of the sweep, telemetry, artefacts.

A run directory holds config.json, requests.jsonl, telemetry.csv, summary.json, the PNG plots
and report.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from treeserve import jsonl
from treeserve.bench import metrics
from treeserve.bench.client import ClientPool, Clock, Endpoint, RequestRecord
from treeserve.bench.datasets import DatasetSpec, sample_requests, tokenizer_vocab_size
from treeserve.bench.load import LoadLevel, run_level, sweep_levels
from treeserve.bench.loop_lag import LoopLagProbe
from treeserve.bench.ready import DEFAULT_READY_TIMEOUT_S, served_models
from treeserve.bench.report import render_level_line, write_report
from treeserve.bench.telemetry import DEFAULT_INTERVAL_S, TelemetryRecorder, parse_prometheus
from treeserve.errors import ParamError
from treeserve.lifecycle import signals_between_callbacks

LIST_FIELDS = {"concurrency": int, "request_rate": float, "input_len": int, "output_len": int}


@dataclass
class BenchConfig:
    base_url: str
    out: str
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    stream: bool = True
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: list[int] = field(default_factory=lambda: [256])
    output_len: list[int | None] = field(default_factory=lambda: [None])
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    shared_prefix_groups: int = 1
    vocab_size: int | None = None
    tokenizer: str | None = None
    concurrency: list[int | None] = field(default_factory=lambda: [None])
    request_rate: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    num_requests: int = 100
    duration: float | None = None
    warmup: int = 0
    seed: int = 0
    goodput: list[str] = field(default_factory=list)
    ignore_eos: bool = True
    temperature: float = 0.0
    telemetry_interval: float = DEFAULT_INTERVAL_S
    server_pid: int | None = None
    plots: bool = True
    ready_check_timeout_sec: float = DEFAULT_READY_TIMEOUT_S  # wait this long for a server still loading; 0: not at all

    def __post_init__(self):
        for name, kind in LIST_FIELDS.items():
            setattr(self, name, as_list(getattr(self, name), kind, name))
        if self.concurrency == [None] and all(math.isinf(r) for r in self.request_rate):
            self.concurrency = [1]
        if self.endpoint not in ("completions", "chat"):
            raise ParamError("endpoint", f"must be 'completions' or 'chat', got '{self.endpoint}'")
        if self.endpoint == "chat" and self.dataset == "random":
            raise ParamError("endpoint", "the random dataset sends token ids, which only 'completions' accepts")
        if self.num_requests < 1 or self.warmup < 0:
            raise ValueError(f"num_requests must be >= 1 and warmup >= 0, got {self.num_requests}/{self.warmup}")
        if self.ready_check_timeout_sec < 0:
            raise ParamError("ready_check_timeout_sec", f"must be >= 0 seconds (0: no waiting), "
                                                        f"got {self.ready_check_timeout_sec}")
        if self.duration is not None and self.duration <= 0:
            raise ParamError("duration", f"must be > 0 seconds, got {self.duration}")
        self.slos = metrics.parse_goodput(self.goodput)
        self.levels = sweep_levels(self.concurrency, self.request_rate, self.burstiness,
                                   self.input_len, self.output_len)

    @classmethod
    def from_dict(cls, values: dict) -> "BenchConfig":
        """Keys as in the command line (dashes or underscores); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        normalised = {key.replace("-", "_"): value for key, value in values.items()}
        unknown = sorted(set(normalised) - names)
        if unknown:
            raise ParamError("bench", f"unknown option(s) {', '.join(unknown)}")
        return cls(**normalised)

    def as_json(self) -> dict:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        row["api_key"] = "***" if self.api_key else None
        row["request_rate"] = [None if math.isinf(r) else r for r in self.request_rate]
        row["levels"] = [level.label() for level in self.levels]
        return row

    def dataset_spec(self, level: LoadLevel) -> DatasetSpec:
        vocab = self.vocab_size or (tokenizer_vocab_size(self.tokenizer) if self.tokenizer else None)
        return DatasetSpec(name=self.dataset, path=self.dataset_path, input_len=level.input_len or 256,
                           output_len=level.output_len, range_ratio=self.range_ratio,
                           shared_prefix_len=self.shared_prefix_len, shared_prefix_groups=self.shared_prefix_groups,
                           tokenizer=self.tokenizer, seed=self.seed, **({"vocab_size": vocab} if vocab else {}))


def as_list(value, kind, name: str) -> list:
    """'1,4,16' or 16 or [1, 4] -> a list; 'inf'/'none' entries mean no limit."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if item is None or (isinstance(item, str) and item.strip().lower() in ("none", "inf", "")):
            out.append(math.inf if name == "request_rate" else None)
            continue
        try:
            out.append(kind(item))
        except (TypeError, ValueError):
            raise ParamError(name, f"'{item}' is not a number") from None
    return out


@dataclass
class RunLog:
    """What a run holds so far: every request sent (in order, finished or not), the summaries of the
    levels that finished, the telemetry. An interrupted run writes what finished from it."""
    model: str | None = None
    records: list[RequestRecord] = field(default_factory=list)
    levels: list[dict] = field(default_factory=list)
    telemetry: TelemetryRecorder | None = None


def run_benchmark(config: BenchConfig) -> dict:
    """Runs every level and writes the run directory; returns the summary. Cut short (Ctrl-C,
    SIGTERM), it writes the requests that finished and their figures, marked interrupted, then
    lets the interruption go on."""
    log = RunLog()
    try:
        with asyncio.Runner() as runner, signals_between_callbacks(runner.get_loop()):
            return runner.run(_run(config, log))
    except (KeyboardInterrupt, SystemExit):
        if log.telemetry is not None:  # (the load had begun)
            _write_interrupted(config, log)
        raise


async def _run(config: BenchConfig, log: RunLog) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    models = await served_models(config.base_url, config.api_key, config.ready_check_timeout_sec)
    model = config.model or models[0]
    endpoint = Endpoint(config.base_url, model, config.endpoint, config.stream, config.api_key,
                        config.ignore_eos, config.temperature)
    clock = Clock()
    write_json(out / "config.json", {**config.as_json(), "model": model, "clock_start_unix": clock.start_unix})
    log.model = model
    log.telemetry = TelemetryRecorder(config.base_url, clock, config.telemetry_interval, config.api_key,
                                      config.server_pid).start()
    try:
        await _run_levels(config, endpoint, clock, log)
    finally:
        log.telemetry.stop()
    return write_run(config, log)


def write_run(config: BenchConfig, log: RunLog, interrupted: bool = False) -> dict:
    """requests.jsonl, telemetry.csv, summary.json and (with plots) the report, from the log."""
    out = Path(config.out)
    log.telemetry.write_csv(out / "telemetry.csv")
    (out / "requests.jsonl").write_text(jsonl.dumps(r.as_json() for r in log.records))
    summary = build_summary(config, log.model, log.levels, log.telemetry)
    if interrupted:
        summary["interrupted"] = True
    write_json(out / "summary.json", summary)
    if config.plots and log.levels:
        write_report(out)
    return summary


def _write_interrupted(config: BenchConfig, log: RunLog) -> None:
    """Keeps the requests that finished; the level cut short is summarised over its finished ones."""
    log.telemetry.stop()
    cut_short = sum(r.end is None for r in log.records)
    log.records = [r for r in log.records if r.end is not None]
    index = len(log.levels)
    done = [r for r in log.records if r.level == index and not r.warmup]
    if done and index < len(config.levels):
        log.levels.append({"level": index, **config.levels[index].label(), **metrics.summarize(done, config.slos),
                           "client": None, "start": min(r.start for r in done), "end": max(r.end for r in done),
                           "interrupted": True, "cut_short": cut_short})
    write_run(config, log, interrupted=True)
    print(f"[bench] interrupted: {len(log.records)} finished requests kept in {config.out} "
          f"({cut_short} in flight left out; summary.json marks the run interrupted)", file=sys.stderr)


async def _run_levels(config: BenchConfig, endpoint: Endpoint, clock: Clock, log: RunLog) -> None:
    axis = sweep_axis(config.levels)
    async with ClientPool() as pool:
        if config.warmup:
            first = config.levels[0]
            warm = sample_requests(config.dataset_spec(first), config.warmup, 0)
            await run_level(pool, endpoint, warm, dataclasses.replace(first, request_rate=math.inf), -1,
                            clock, seed=config.seed, warmup=True, sent=log.records)
        for i in range(len(config.levels)):
            summary = await _measure_level(config, pool, endpoint, clock, i, log.records)
            log.levels.append(summary)
            print(f"[bench] level {i + 1}/{len(config.levels)} {render_level_line(summary, axis)}", file=sys.stderr)


async def _measure_level(config: BenchConfig, pool: ClientPool, endpoint: Endpoint,
                         clock: Clock, i: int, sent: list[RequestRecord]) -> dict:
    """One level, with the server's counters scraped around it and the client's lag probed during it."""
    level = config.levels[i]
    samples = sample_requests(config.dataset_spec(level), config.num_requests, len(sent))
    before = await scrape_async(pool.session, config)
    probe = LoopLagProbe().start()
    done = await run_level(pool, endpoint, samples, level, i, clock, first_index=len(sent),
                           duration=config.duration, seed=config.seed + i, sent=sent)
    client_overhead = await probe.stop()
    after = await scrape_async(pool.session, config)
    summary = metrics.summarize(done, config.slos, metrics.server_deltas(before, after) if after else None)
    return {"level": i, **level.label(), **summary, "client": client_overhead,
                  "start": min((r.start for r in done), default=None),
                  "end": max((r.end for r in done if r.end is not None), default=None)}


async def scrape_async(session: aiohttp.ClientSession, config: BenchConfig) -> dict[str, float]:
    """The server's metrics now, or {} when it has none."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with session.get(f"{config.base_url.rstrip('/')}/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30.0)) as response:
            return parse_prometheus(await response.text()) if response.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


def build_summary(config: BenchConfig, model: str, levels: list[dict], telemetry: TelemetryRecorder) -> dict:
    axis = sweep_axis(config.levels)
    saturation = metrics.saturation_index([level["output_throughput"] for level in levels])
    return {"model": model, "base_url": config.base_url, "axis": axis, "levels": levels,
            "saturation": None if saturation is None else {
                "level": saturation, axis: levels[saturation].get(axis),
                "output_throughput": levels[saturation]["output_throughput"],
                "fraction_of_best": metrics.SATURATION_FRACTION, "reached": saturation < len(levels) - 1},
            "telemetry": {"rows": len(telemetry.rows), "failed_scrapes": telemetry.failed_scrapes,
                          "interval_s": config.telemetry_interval}}


def sweep_axis(levels: list[LoadLevel]) -> str:
    """The level parameter that varies (the first that does), for plots and tables."""
    for name in ("concurrency", "request_rate", "input_len", "output_len"):
        if len({getattr(level, name) for level in levels}) > 1:
            return name
    return "concurrency"


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")
