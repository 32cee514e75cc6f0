"""Load shapes: fixed concurrency, a request rate with Poisson or gamma arrivals, limits, warm-up.

A level is one point of a sweep: its concurrency cap, arrival rate, burstiness and lengths. Arrival
gaps are gamma-distributed with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson
process, below 1 burstier, above 1 more regular), as in vLLM's benchmark.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import random
from dataclasses import asdict, dataclass

from treeserve.bench.client import ClientPool, Clock, Endpoint, RequestRecord, send_request
from treeserve.bench.datasets import SampleRequest
from treeserve.errors import ParamError


@dataclass(frozen=True)
class LoadLevel:
    concurrency: int | None = None  # None: no cap
    request_rate: float = math.inf  # requests per second; inf sends everything at once
    burstiness: float = 1.0
    input_len: int | None = None
    output_len: int | None = None

    def __post_init__(self):
        if self.concurrency is not None and self.concurrency < 1:
            raise ParamError("concurrency", f"must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ParamError("request_rate", f"must be > 0 (inf for no pacing), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ParamError("burstiness", f"must be > 0, got {self.burstiness}")

    def label(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def sweep_levels(concurrency: list[int | None], request_rate: list[float], burstiness: float,
                 input_len: list[int | None], output_len: list[int | None]) -> list[LoadLevel]:
    """Every combination, concurrency varying fastest."""
    return [LoadLevel(c, r, burstiness, i, o)
            for i, o, r, c in itertools.product(input_len, output_len, request_rate, concurrency)]


def arrival_gaps(count: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request (the first one goes at once)."""
    if math.isinf(rate):
        return [0.0] * count
    scale = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, scale) for _ in range(count - 1)]


async def run_level(client: ClientPool, endpoint: Endpoint, samples: list[SampleRequest],
                    level: LoadLevel, level_index: int, clock: Clock, *, first_index: int = 0,
                    duration: float | None = None, seed: int = 0, warmup: bool = False,
                    sent: list[RequestRecord] | None = None) -> list[RequestRecord]:
    """Sends `samples` at the level's pace under its concurrency cap; stops issuing after `duration`
    seconds (requests already sent run to completion). Each record is also appended to `sent` as it
    is sent, so that a run cut short still holds the requests that had finished.

    The requests run in a task group: a level abandoned midway (Ctrl-C's SystemExit raised while this
    loop runs) cancels the requests in flight and waits for them before the exit goes on, so they
    end cut short (no `end`), never failed by the pool being closed under them."""
    gate = asyncio.Semaphore(level.concurrency) if level.concurrency else None
    gaps = arrival_gaps(len(samples), level.request_rate, level.burstiness, random.Random(seed))
    began, tasks, next_at = clock.now(), [], clock.now()
    async with asyncio.TaskGroup() as group:
        for offset, (sample, gap) in enumerate(zip(samples, gaps)):
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - clock.now()))
            if gate is not None:
                await gate.acquire()
            if duration is not None and clock.now() - began >= duration:
                if gate is not None:
                    gate.release()
                break
            record = RequestRecord(index=first_index + offset, level=level_index, warmup=warmup, start=clock.now())
            if sent is not None:
                sent.append(record)
            tasks.append(group.create_task(_send_then_release(client, endpoint, sample, record, clock, gate)))
    return [task.result() for task in tasks]


async def _send_then_release(client, endpoint, sample, record, clock, gate) -> RequestRecord:
    try:
        return await send_request(client, endpoint, sample, record, clock)
    finally:
        if gate is not None:
            gate.release()
