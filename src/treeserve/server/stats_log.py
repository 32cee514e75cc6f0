"""The periodic stats line vLLM's server logs (`--disable-log-stats` turns it off): per served model,
every `TREESERVE_LOG_STATS_INTERVAL` seconds (10, as vLLM's `VLLM_LOG_STATS_INTERVAL`), prompt and
generation throughput over the interval, requests running and waiting, KV cache usage and the prefix
cache hit rate. Read from the same plain numbers a /metrics scrape formats (server/metrics.py), on a
thread of its own: it never waits for the engine thread. An idle server (no tokens in this interval
nor the last) logs it at DEBUG, as vLLM does, so that an idle production log stays quiet."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from treeserve.server.engine_metrics import EngineMetrics
from treeserve.server.metrics import ServerMetrics

log = logging.getLogger("treeserve.server.stats")
DEFAULT_INTERVAL = 10.0


@dataclass
class _Last:
    time: float
    prompt: float
    generation: float
    queries: float
    hits: float
    active: bool = True  # tokens moved in the interval before (the first line after a start is shown)


def log_stats_interval() -> float:
    """TREESERVE_LOG_STATS_INTERVAL's seconds; ValueError naming it unless a positive number (0 made
    the logging thread spin, holding the GIL the engine thread needs)."""
    text = os.environ.get("TREESERVE_LOG_STATS_INTERVAL", str(DEFAULT_INTERVAL))
    try:
        interval = float(text)
    except ValueError:
        interval = float("nan")
    if not interval > 0 or interval == float("inf"):
        raise ValueError(f"TREESERVE_LOG_STATS_INTERVAL must be a positive number of seconds, got {text!r}")
    return interval


class StatsLog:
    def __init__(self, metrics: ServerMetrics, clock=time.monotonic):
        self.metrics, self.clock = metrics, clock
        self._last: dict[str, _Last] = {}
        for model in self._models():
            self._last[model.model_name] = self._read(model, clock())

    def _models(self) -> list[EngineMetrics]:
        return list(self.metrics.by_engine.values())

    @staticmethod
    def _read(model: EngineMetrics, now: float) -> _Last:
        return _Last(now, model.prompt_tokens.value, model.generation_tokens.value, model.prefix_queries.value,
                     model.prefix_hits.value)

    def log(self) -> None:
        """One line per served model, for the interval since the last call."""
        now = self.clock()
        for model in self._models():
            current = self._read(model, now)
            last = self._last.get(model.model_name, current)
            elapsed = max(now - last.time, 1e-9)
            prompt = (current.prompt - last.prompt) / elapsed
            generation = (current.generation - last.generation) / elapsed
            queries, hits = current.queries - last.queries, current.hits - last.hits
            current.active = bool(prompt or generation)
            level = logging.INFO if current.active or last.active else logging.DEBUG
            log.log(level, "Model %s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    model.model_name, prompt, generation, model.running.value, model.waiting.value,
                    100 * model.kv_usage.value, 100 * hits / queries if queries else 0.0)
            self._last[model.model_name] = current

    def start(self, interval: float | None = None) -> threading.Event:
        """Logs every `interval` seconds on a daemon thread until the returned event is set."""
        interval = interval or log_stats_interval()
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval):
                self.log()
        threading.Thread(target=run, name="treeserve-stats-log", daemon=True).start()
        return stop
