"""The client's own overhead during a run: how late its event loop wakes up."""
from __future__ import annotations

import asyncio
import contextlib
import time

from treeserve.bench.metrics import distribution

PROBE_INTERVAL_S = 0.01


class LoopLagProbe:
    """Sleeps `interval` over and over and records how late each wake-up is: every timestamp the
    client takes can be late by as much, so it bounds what the client adds to TTFT and ITL."""

    def __init__(self, interval: float = PROBE_INTERVAL_S):
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.lags.append(time.perf_counter() - asked - self.interval)

    def start(self) -> "LoopLagProbe":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> dict:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return self.summary()

    def summary(self) -> dict:
        stats = distribution(self.lags)
        return {"event_loop_lag_ms": {k: stats[k] for k in ("count", "mean", "median", "p99")},
                "event_loop_lag_max_ms": max(self.lags) * 1000.0 if self.lags else None}
