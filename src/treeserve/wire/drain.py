"""Graceful drain of an HTTP server (`treeserve serve` and the gateway; issue #40).

The first SIGTERM or SIGINT starts a drain: `/health/ready` answers 503 at once (a load balancer,
or the gateway's health check, stops sending), new requests get 503 with `Retry-After` (a client or
the gateway tries another replica), and the requests already running, streams and searches
included, run to their end. The server exits when none is left, or after `--shutdown-timeout`
seconds, whichever comes first; `/health` (liveness) stays 200 until then. A second signal exits
at once.
"""
from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable

import uvicorn
from fastapi.responses import Response

from treeserve.wire.errors import error_response

log = logging.getLogger("treeserve.drain")
# Answered while draining: the probes and the metrics a supervisor reads (the gateway's liveness and
# readiness under LiteLLM's names too: a liveness probe that failed while draining would restart it).
EXEMPT_PATHS = frozenset({"/health", "/health/ready", "/ping", "/metrics", "/health/live", "/health/liveliness",
                          "/health/liveness", "/health/readiness"})
RETRY_AFTER_S = 1
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
KEEP_ALIVE_S = 75  # nginx's default; see `uvicorn_config`
CUT_GRACE_S = 2.0  # after the time is up: for the requests cut (Drain.on_time_up) to end and be settled


class Drain:
    """One server's readiness and its requests in flight (touched on its event loop only, but for
    `begin`, which a signal handler calls: one assignment)."""

    def __init__(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"--shutdown-timeout: expected a number of seconds >= 0, got {timeout}")
        self.timeout = timeout
        self.since: float | None = None
        self.in_flight = 0
        self.forced = False  # a second signal came: exit without waiting (children too)
        # Called once when the time is up with requests still running: each ends what it can end
        # cleanly (the gateway cuts its relayed streams with an error event and bills them).
        self.on_time_up: list[Callable[[], None]] = []
        self.cut_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> bool:
        """Starts the drain; False if it had started already."""
        if self.since is not None:
            return False
        self.since = time.monotonic()
        return True

    def finished(self) -> bool:
        """Draining, and nothing is left in flight, or the time is up and what was cut has had
        CUT_GRACE_S to end (uvicorn cancels what is left: nothing of it can be answered then)."""
        if self.since is None:
            return False
        if self.in_flight == 0:
            return True
        now = time.monotonic()
        if now - self.since < self.timeout:
            return False
        if self.cut_at is None:
            self.cut_at = now
            for cut in self.on_time_up:
                cut()
        return not self.on_time_up or now - self.cut_at >= CUT_GRACE_S


class DrainMiddleware:
    """Counts the requests in flight (a stream until its last byte) and, while draining, answers
    new ones 503 (`Retry-After`, `Connection: close`); the probes and /metrics are always answered."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = error_response(503, "the server is shutting down: send the request to another replica",
                                      code="shutting_down",
                                      headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def readiness(drain: Drain, failure: str | None = None):
    """The response of `/health/ready`: 503 while draining or when `failure` (the engine's) is set."""
    if drain.draining:
        return error_response(503, "draining: the server is shutting down", code="shutting_down")
    if failure is not None:
        return error_response(503, f"engine failed: {failure}")
    return Response(status_code=200)


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain above on SIGTERM and SIGINT. In the main thread uvicorn routes both
    signals here; elsewhere the caller's handler calls `handle_exit`. No signal is raised again
    after the shutdown (uvicorn's own way), so the caller's cleanup runs and the exit status is 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain, name: str = "server"):
        super().__init__(config)
        self.drain, self.name = drain, name

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain.begin():
            log.info("%s: %s: draining %d request(s) in flight for up to %g s; new ones get 503 (another signal "
                     "exits now)", self.name, signal.Signals(sig).name, self.drain.in_flight, self.drain.timeout)
        else:
            log.warning("%s: %s again: exiting now", self.name, signal.Signals(sig).name)
            self.drain.forced = self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.finished():
            left = self.drain.in_flight
            log.info("%s: drained%s; stopping", self.name,
                     f" (time is up: {left} request(s) still running are cancelled)" if left else
                     " (time is up: the requests still running were cut)" if self.drain.cut_at else "")
            self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app, **options) -> uvicorn.Config:
    """A Config for DrainingServer: the drain has waited already, so uvicorn's own grace is short.
    An idle kept-alive connection stays open KEEP_ALIVE_S, longer than clients keep theirs (httpx
    and the openai client 5 s, aiohttp 15 s): the client always closes first. With uvicorn's 5 s
    the two timers race, and a request sent on a connection the server is closing is lost (seen
    as ReadError by 4 of 1,745 requests through the gateway under load)."""
    return uvicorn.Config(app, timeout_graceful_shutdown=1, timeout_keep_alive=KEEP_ALIVE_S, **options)
