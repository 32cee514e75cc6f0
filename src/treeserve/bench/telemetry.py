"""Telemetry during a run: the server's /metrics every 200 ms, host CPU/memory, GPUs when present.

Each scrape becomes one row keyed by series (`name{label="value",...}`, as Prometheus writes it);
`telemetry.csv` gets the union of every series seen, so a series that appears mid-run gets a
column and the rows before it stay empty. Rows carry `t`, seconds on the run's clock (the clock of
requests.jsonl), and `time_unix`.
"""
from __future__ import annotations

import csv
import re
import threading
from pathlib import Path

import httpx

from treeserve.bench.client import Clock
from treeserve.errors import ParamError

DEFAULT_INTERVAL_S = 0.2
TIME_COLUMNS = ("t", "time_unix")


class ExpositionReader:
    """Reads Prometheus' text format into {series: value}, series keyed `name{k="v",...}` (labels
    sorted, `_created` stamps left out), as prometheus_client's parser reads it, at a tenth of its
    cost: a series' key is worked out the first time its line's text is seen and looked up after, so
    a scrape costs a split and a float per line. That parser spent 6-13 ms of CPU a scrape of a
    two-model server, which the load generator's process takes from the engine's cores on a small
    machine (tests/test_bench_metrics.py checks the two agree)."""

    def __init__(self):
        self.keys: dict[str, str | None] = {}  # a line's text before its value -> its key (None: skipped)

    def read(self, text: str) -> dict[str, float]:
        samples = {}
        for line in text.splitlines():
            if not line or line[0] == "#":
                continue
            series, value = _split_sample(line)
            key = self.keys.get(series, "")
            if key == "":
                key = self.keys[series] = _series_key(series)
            if key is not None:
                samples[key] = float(value)
        return samples


def _split_sample(line: str) -> tuple[str, str]:
    """`name{labels} value [timestamp]` -> (`name{labels}`, value); a label value may hold spaces."""
    end = line.rfind("}") + 1 if "{" in line else line.find(" ")
    return line[:end], line[end:].split(None, 1)[0]


LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
UNESCAPE = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def _series_key(series: str) -> str | None:
    name, _, labels = series.partition("{")
    if name.endswith("_created"):
        return None
    pairs = sorted((key, re.sub(r'\\[\\n"]', lambda m: UNESCAPE[m.group(0)], value))
                   for key, value in LABEL.findall(labels))
    text = ",".join(f'{key}="{value}"' for key, value in pairs)
    return f"{name}{{{text}}}" if text else name


def parse_prometheus(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, keyed by series; `_created` stamps are left out."""
    return ExpositionReader().read(text)


def scrape(client: httpx.Client, url: str, headers: dict, reader: ExpositionReader) -> dict[str, float]:
    response = client.get(url, headers=headers)
    response.raise_for_status()
    return reader.read(response.text)


class HostProbe:
    """Host CPU and memory (psutil), the server process when its pid is known, GPUs via pynvml."""

    def __init__(self, server_pid: int | None = None):
        import psutil

        self.psutil = psutil
        psutil.cpu_percent(None)
        self.process = self._process(server_pid)
        self.gpus = gpu_handles()

    def _process(self, pid):
        if pid is None:
            return None
        try:
            process = self.psutil.Process(pid)
            process.cpu_percent(None)
            return process
        except self.psutil.Error:
            return None

    def read(self) -> dict[str, float]:
        memory = self.psutil.virtual_memory()
        row = {"host_cpu_percent": self.psutil.cpu_percent(None), "host_memory_used_bytes": float(memory.used),
               "host_memory_percent": memory.percent}
        if self.process is not None:
            try:
                row["server_cpu_percent"] = self.process.cpu_percent(None)
                row["server_rss_bytes"] = float(self.process.memory_info().rss)
            except self.psutil.Error:
                self.process = None
        row.update(read_gpus(self.gpus))
        return row


def gpu_handles() -> list:
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no pynvml, no driver, no GPU: no GPU columns
        return []


def read_gpus(handles: list) -> dict[str, float]:
    if not handles:
        return {}
    import pynvml

    row = {}
    for i, handle in enumerate(handles):
        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            row[f"gpu{i}_utilization_percent"] = float(util.gpu)
            row[f"gpu{i}_memory_used_bytes"] = float(memory.used)
            row[f"gpu{i}_power_watts"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:
            continue
    return row


class TelemetryRecorder:
    """Scrapes on its own thread every `interval` seconds until `stop()`."""

    def __init__(self, base_url: str, clock: Clock, interval: float = DEFAULT_INTERVAL_S,
                 api_key: str | None = None, server_pid: int | None = None):
        if interval <= 0:
            raise ParamError("telemetry_interval", f"must be > 0 seconds, got {interval}")
        self.url = f"{base_url.rstrip('/')}/metrics"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.clock, self.interval = clock, interval
        self.host = HostProbe(server_pid)
        self.rows: list[dict[str, float]] = []
        self.failed_scrapes = 0
        self.reader = ExpositionReader()
        self._stop, self._first_row = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-telemetry", daemon=True)

    def start(self) -> "TelemetryRecorder":
        """Starts the scraping thread; returns once its first row (the baseline before any load) is in."""
        self._thread.start()
        self._first_row.wait(timeout=max(5.0, 10 * self.interval))
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=max(1.0, 5 * self.interval)) as client:
            next_at = self.clock.now()
            while not self._stop.is_set():
                self.record_once(client)
                self._first_row.set()
                next_at += self.interval
                self._stop.wait(max(0.0, next_at - self.clock.now()))
            self.record_once(client)  # a last row after the load is done

    def record_once(self, client: httpx.Client) -> None:
        t = self.clock.now()
        row = {"t": t, "time_unix": self.clock.unix(t)}
        try:
            row.update(scrape(client, self.url, self.headers, self.reader))
        except Exception:
            self.failed_scrapes += 1
        row.update(self.host.read())
        self.rows.append(row)

    def write_csv(self, path: Path) -> list[str]:
        return write_union_csv(self.rows, path)


def write_union_csv(rows: list[dict[str, float]], path: Path) -> list[str]:
    """One column per key seen in any row (first-seen order after the time columns); gaps stay empty."""
    header = list(TIME_COLUMNS)
    seen = set(header)
    for row in rows:
        for key in row:
            if key not in seen:
                seen.add(key)
                header.append(key)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return header


def read_csv(path: Path) -> tuple[list[str], list[dict[str, float | None]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in reader]
        return list(reader.fieldnames or []), rows
