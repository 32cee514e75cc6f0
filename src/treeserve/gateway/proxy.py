"""Forwarding one request: try the planned backends in order until one answers, relay its answer,
and settle the request's cost exactly once.

Retries (a connection error, a timeout, 429 or 503) happen only before anything reached the
client: a non-streamed answer is read whole first; a stream is committed once its first event has
arrived, and a stream that breaks after that ends with an error event, never replayed. Streams are
asked for `usage` in every chunk (`stream_options.continuous_usage_stats`), so a stream cut by a
backend or by the client is billed for the tokens its client got."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import anyio
from fastapi.responses import Response, StreamingResponse

from treeserve.gateway.broker import BrokerStream
from treeserve.gateway.config import scrubbed
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.pricing import completion_cap
from treeserve.gateway.routing import Backend, Router
from treeserve.gateway.sse import DONE, StreamState, error_event, event_batches
from treeserve.gateway.upstreams import Upstreams
from treeserve.gateway.usage import Usage, answer_usage
from treeserve.wire.errors import error_response

log = logging.getLogger("treeserve.gateway")
RETRYABLE_STATUS = {429, 503}
GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/search"}  # the routes a model's max_tokens cap binds
# What a client is told when a backend's stream breaks (the exception's name is the operator's: the log has it)
STREAM_CUT = "the model's answer broke off (its server stopped answering); it is not replayed: try again in a moment"
# What a failed attempt raises: connection refused or reset, the server gone mid-answer, a timeout.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
# ... or a request aiohttp refuses to build from a backend's settings (a ValueError): the gateway's
# configuration, never the client's request
SEND_ERRORS = (*UPSTREAM_ERRORS, ValueError)


class GatewayStopping(ConnectionError):
    """Raised into the relayed streams still running when the gateway's drain time is up."""


class StreamEndedEarly(ConnectionError):
    """A backend's stream that ended without its [DONE]: cut, as one that broke."""


@dataclass
class Throttled:
    """A failed attempt the backend answered 429: its body and Retry-After, passed on when every
    attempt was throttled (as LiteLLM does)."""
    reason: str
    content: bytes
    headers: dict[str, str]

    def __str__(self) -> str:
        return self.reason


@dataclass
class Outcome:
    """How a request ended, for its settlement."""
    status: str = "error"         # success, error (nothing served), cut (stream broke), client_closed
    model: str | None = None      # the model group that answered (a fallback's, after a fallback)
    backend: str | None = None
    usage: Usage = field(default_factory=Usage)
    answer: tuple[int, bytes] | None = None  # a whole answer's HTTP status and body (what a batch line keeps)


class RelayResponse(StreamingResponse):
    """A relayed stream whose generator is closed as soon as the response ends, however it ends
    (a client gone mid-write included), so its upstream is closed and it is settled at once."""

    def __init__(self, content, *args, also_close=None, **kwargs):
        """`also_close`: an async iterator started before the response (a chat restart's answer), closed
        with it even if the response ended before its generator began (which then runs no `finally`)."""
        super().__init__(content, *args, **kwargs)
        self.also_close = also_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self.also_close is not None:
                    await self.also_close.aclose()


class Forwarder:
    def __init__(self, router: Router, upstreams: Upstreams, metrics: GatewayMetrics, retries: int,
                 stopping: Callable[[], bool] = lambda: False):
        self.router, self.upstreams, self.metrics, self.retries = router, upstreams, metrics, retries
        self.stopping = stopping  # the gateway shutting down: a request cancelled then was not left by its client
        self.streams: dict[int, Callable[[BaseException], None]] = {}  # relays running: how to cut each

    def cut_streams(self) -> None:
        """Ends every relayed stream still running with an error event (each is billed for what its
        client got): the drain's time is up (wire/drain.py)."""
        if self.streams:
            log.warning("the drain's time is up: cutting %d stream(s) still running", len(self.streams))
        for cut in list(self.streams.values()):
            cut(GatewayStopping("the gateway is shutting down"))

    async def forward(self, path: str, body: dict, model: str, affinity: str | None,
                      settle: Callable[[Outcome], "anyio.abc.Awaitable"], started: float, request_id: str,
                      headers: dict[str, str] | None = None, has_client: bool = True) -> Response:
        """`settle` is awaited when the request has ended, before its client has the end (for a
        stream: when its [DONE] is in hand, else when the stream has ended, however it ended); it
        must be idempotent (a failure path may call it again). `headers` go to HTTP backends with
        the request (a batch line's Idempotency-Key). Cancelled, a request with a client (not a batch
        line) is settled `client_closed` unless the gateway is stopping."""
        failures: list[str | Throttled] = []
        try:
            for attempt, (group, backend) in enumerate(self.router.plan(model, affinity, 1 + self.retries)):
                if attempt:
                    self.metrics.retries.labels(model).inc()
                result = await self._attempt(path, body, group, backend, settle, started, headers,
                                             f"{request_id}.{attempt}")
                if isinstance(result, Response):
                    result.headers["x-request-id"] = request_id
                    return result
                failures.append(result)
        except BaseException as exc:
            left = isinstance(exc, asyncio.CancelledError) and has_client and not self.stopping()
            with anyio.CancelScope(shield=True):  # (its client gone: nothing served, its upstream stopped)
                await settle(Outcome("client_closed" if left else "error", model))
            if left:
                self._count(model, "", "499", started)
            raise
        await settle(Outcome("error", model))
        return self._unanswered(model, failures, request_id, started)

    def _unanswered(self, model: str, failures: list[str | Throttled], request_id: str, started: float) -> Response:
        """Every attempt failed: the last 429 as its backend wrote it (its Retry-After too) when each
        attempt was throttled, else a 503."""
        if failures and all(isinstance(f, Throttled) for f in failures):
            self._count(model, "", "429", started)
            return Response(failures[-1].content, status_code=429, media_type="application/json",
                            headers=failures[-1].headers | {"x-request-id": request_id})
        self._count(model, "", "503", started)
        last_error, retry_after = (failures[-1], 1) if failures else self.router.unavailable(model)
        return error_response(503, f"model {model!r}: no backend could answer ({last_error})",
                              code="no_backend_available",
                              headers={"Retry-After": str(retry_after), "x-request-id": request_id})

    # ---- one attempt -------------------------------------------------------------------------
    async def _attempt(self, path, body, group, backend: Backend, settle, started, headers,
                       attempt_id: str) -> Response | str | Throttled:
        stream = bool(body.get("stream"))
        upstream = self._upstream_body(path, body, group, backend, stream)
        if backend.url in self.upstreams.brokers:  # each attempt its own correlation id: no late reply mixes in
            return await self._try_broker(path, upstream, backend, group, body, settle, started, attempt_id)
        attempt_once = self._try_stream if stream else self._try_once
        return await attempt_once(path, upstream, backend, group, body, settle, started, headers)

    async def _try_once(self, path, upstream, backend: Backend, group, body, settle, started,
                        headers=None) -> Response | str:
        self._begin(backend)
        try:
            async with self.upstreams.client.post(backend.endpoint(path), json=upstream,
                                                  headers=_headers(backend, headers),
                                                  timeout=_timeout(backend, whole=True)) as response:
                status, content, headers = response.status, await response.read(), _retry_after(response)
        except SEND_ERRORS as exc:
            return self._failed(backend, exc)
        finally:
            self._end(backend)
        return await self._answer(status, content, headers, backend, group, settle, started)

    async def _answer(self, status: int, content: bytes, headers: dict, backend: Backend, group: str, settle,
                      started: float) -> Response | str:
        """A whole answer relayed (or, for 429/503, a failed attempt)."""
        if status in RETRYABLE_STATUS:
            return self._retryable(backend, status, content, headers)
        outcome = Outcome("success" if status == 200 else "error", group, backend.name, answer=(status, content))
        if status == 200:
            usage = answer_usage(content, backend.name)
            if usage is None:
                return await self._invalid_answer(backend, group, settle, started)
            outcome.usage = usage
        self._record_health(backend, status)
        await settle(outcome)
        self._count(group, backend.name, str(status), started)
        return Response(content, status_code=status, media_type="application/json", headers=headers)

    async def _invalid_answer(self, backend: Backend, group: str, settle, started: float) -> Response:
        """A 200 whose body is not a JSON object: the backend's failure (its breaker counts it), a
        502 billed nothing (it is not retried: the backend may have generated the answer)."""
        self._failed(backend, "HTTP 200 whose body is not a JSON object")
        refusal = error_response(502, f"model {group!r}: its backend answered 200 with a body that is not JSON",
                                 code="backend_invalid_response")
        # (the answer kept: a batch line is written with it, and so goes to the batch's error file)
        await settle(Outcome("error", group, backend.name, answer=(502, bytes(refusal.body))))
        self._count(group, backend.name, "502", started)
        return refusal

    def _retryable(self, backend: Backend, status: int, content: bytes, headers: dict) -> str | Throttled:
        reason = self._failed(backend, f"HTTP {status}", breaker=status == 503)
        return Throttled(reason, content, headers) if status == 429 else reason

    async def _try_stream(self, path, upstream, backend: Backend, group, body, settle, started,
                          headers=None) -> Response | str:
        self._begin(backend)
        try:
            response = await self.upstreams.client.post(backend.endpoint(path), json=upstream,
                                                        headers=_headers(backend, headers),
                                                        timeout=_timeout(backend, whole=False))
        except SEND_ERRORS as exc:
            self._end(backend)
            return self._failed(backend, exc)
        except BaseException:  # cancelled (its client left, the gateway stops): the backend is no longer busy
            self._end(backend)
            raise
        if response.status != 200:
            try:
                content = await response.read()
            except UPSTREAM_ERRORS as exc:
                content = json.dumps({"error": {"message": f"the backend failed: {exc}"}}).encode()
            finally:  # (cancelled too)
                response.release()
                self._end(backend)
            if response.status in RETRYABLE_STATUS:
                return self._retryable(backend, response.status, content, _retry_after(response))
            self._record_health(backend, response.status)
            await settle(Outcome("error", group, backend.name))
            self._count(group, backend.name, str(response.status), started)
            return Response(content, status_code=response.status, media_type="application/json")
        batches = event_batches(response)
        try:
            first = await batches.__anext__()
        except (*UPSTREAM_ERRORS, StopAsyncIteration) as exc:
            response.close()
            self._end(backend)
            return self._failed(backend, exc if not isinstance(exc, StopAsyncIteration) else "the stream ended at once")
        except BaseException:  # cancelled before the first event: the upstream closed (the backend aborts it)
            response.close()
            self._end(backend)
            raise
        return self._stream_response(first, batches, _closer(response), response.content.set_exception, backend,
                                     group, body, settle, started)

    async def _try_broker(self, path, upstream, backend: Backend, group, body, settle, started,
                          request_id: str) -> Response | str:
        broker = self.upstreams.brokers[backend.url]
        self._begin(backend)
        try:
            replies = await broker.request(backend.config.model or group, path, upstream, request_id,
                                           backend.config.timeout)
            reply = BrokerStream(broker, request_id, replies, backend.config.timeout)
            first = await reply.first()
        except BaseException as exc:  # the broker's errors include RuntimeErrors of a closed channel
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await broker.cancel(request_id)  # (the worker holding it stops it)
            self._end(backend)
            if not isinstance(exc, Exception):  # cancelled (its client left, the gateway stops)
                raise
            return self._failed(backend, exc if str(exc) else "no worker answered in time")
        if first.kind == "response":
            try:
                await reply.close()
            finally:  # (cancelled too)
                self._end(backend)
            return await self._answer(first.status, first.body, {}, backend, group, settle, started)
        return self._stream_response(first.events, reply.batches(), reply.close, reply.cut, backend, group, body,
                                     settle, started)

    def _stream_response(self, first, batches, close, cut, backend, group, body, settle, started) -> RelayResponse:
        """`cut(exc)` makes the stream's next read raise `exc`."""
        options = body.get("stream_options") or {}
        state = StreamState(bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")),
                            backend.name)
        relay = self._relay(first, batches, close, cut, backend, group, state, settle, started)
        return RelayResponse(relay, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _relay(self, first: list[bytes], batches: AsyncIterator[list[bytes]],
                     close: Callable[[], Awaitable[None]], cut: Callable[[BaseException], None], backend: Backend,
                     group: str, state: StreamState, settle, started: float) -> AsyncIterator[bytes]:
        outcome = Outcome("client_closed", group, backend.name)
        self.streams[id(state)] = cut
        try:
            out = state.relay(first)
            await _settle_when_whole(state, outcome, settle)
            if out:
                yield out
            self.metrics.ttft.labels(group).observe(time.perf_counter() - started)
            async for batch in batches:
                out = state.relay(batch)
                await _settle_when_whole(state, outcome, settle)
                if out:
                    yield out
            if not state.done:
                raise StreamEndedEarly("the stream ended without [DONE]")
            outcome.status = "success"
            backend.breaker.on_success()
        except GatewayStopping:
            outcome.status = "cut"
            yield error_event("the gateway is shutting down: this stream was cut (its drain time was up)",
                              "shutting_down") + DONE
        except UPSTREAM_ERRORS as exc:
            outcome.status = "cut"
            self._failed(backend, exc)
            yield error_event(STREAM_CUT, "backend_stream_cut") + DONE  # (the exception is in the log: _failed)
        finally:
            self.streams.pop(id(state), None)
            if outcome.status == "client_closed" and state.done:
                outcome.status = "success"  # the client left after the last event: it has it all
            with anyio.CancelScope(shield=True):
                try:
                    await close()
                except Exception:  # (a broker gone: its cancel cannot be sent) the request is settled anyway
                    log.exception("closing the upstream of a stream failed")
                self._end(backend)
                outcome.usage = state.billed()
                await settle(outcome)
            status = {"success": "200", "cut": "502"}.get(outcome.status, "499")
            self._count(group, backend.name, status, started)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _count(self, model: str, backend: str, status: str, started: float) -> None:
        self.metrics.answered(model, backend, status, time.perf_counter() - started)

    def _upstream_body(self, path: str, body: dict, group: str, backend: Backend, stream: bool) -> dict:
        upstream = dict(body, model=backend.config.model or group)
        if not backend.config.priority:  # (a backend that rejects it: OpenAI's, vLLM's without the priority policy)
            upstream.pop("priority", None)
        cap = self.router.groups[group].config.max_tokens
        # what generates (a search too: per generation call); a reward request generates nothing, and
        # its body takes no max_tokens
        asks = path in GENERATING and any(k in body for k in ("messages", "prompt", "question"))
        if cap is not None and asks and completion_cap(body) is None:
            upstream["max_tokens"] = cap  # the reservation counted this cap: the backend must not write more
        if stream and ("messages" in body or "prompt" in body):
            options = dict(body.get("stream_options") or {}, include_usage=True)
            if backend.config.continuous_usage:
                options["continuous_usage_stats"] = True
            else:  # (a backend that rejects it: the client's ask is dropped, the gateway counts what it relays)
                options.pop("continuous_usage_stats", None)
            upstream["stream_options"] = options
        return upstream

    def _begin(self, backend: Backend) -> None:
        backend.breaker.on_start()
        backend.outstanding += 1
        self.metrics.backend_outstanding.labels(backend.name).set(backend.outstanding)

    def _end(self, backend: Backend) -> None:
        backend.breaker.trial_in_flight = False  # a trial that ended without a verdict allows another
        backend.outstanding -= 1
        self.metrics.backend_outstanding.labels(backend.name).set(backend.outstanding)

    def _failed(self, backend: Backend, error, breaker: bool = True) -> str:
        reason = type(error).__name__ if isinstance(error, BaseException) else str(error)
        text = f"{backend.name}: {reason}" + (f" ({error})" if isinstance(error, BaseException) and str(error) else "")
        text = scrubbed(text, backend.url)  # (an aiohttp error may quote the URL, its query's key and all)
        backend.last_error = text
        if breaker:
            backend.breaker.on_failure()
            self.metrics.breaker_open.labels(backend.name).set(int(backend.breaker.state == "open"))
        self.metrics.backend_failures.labels(backend.name, reason).inc()
        log.warning("backend failed: %s", text)
        return text

    def _record_health(self, backend: Backend, status: int) -> None:
        if status >= 500:
            backend.breaker.on_failure()
        else:
            backend.breaker.on_success()
        self.metrics.breaker_open.labels(backend.name).set(int(backend.breaker.state == "open"))


def _closer(response: aiohttp.ClientResponse) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        response.close()  # not released to the pool: an unfinished stream's connection is dropped
    return close


def _retry_after(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {"Retry-After": response.headers["Retry-After"]} if "Retry-After" in response.headers else {}


def _headers(backend: Backend, extra: dict[str, str] | None = None) -> dict[str, str]:
    auth = {"Authorization": f"Bearer {backend.config.api_key}"} if backend.config.api_key else {}
    return auth | extra if extra else auth


def _timeout(backend: Backend, whole: bool) -> aiohttp.ClientTimeout:
    """A non-streamed answer gets `timeout` in all; a stream gets it between chunks."""
    if whole:
        return aiohttp.ClientTimeout(total=backend.config.timeout, connect=backend.config.connect_timeout)
    return aiohttp.ClientTimeout(total=None, connect=backend.config.connect_timeout, sock_read=backend.config.timeout)


async def _settle_when_whole(state: StreamState, outcome: Outcome, settle) -> None:
    """A stream whose [DONE] is in hand is settled before its client reads it, as a whole answer is
    before it is sent: what it held (a parallel slot, a budget's worst case) is given back by the
    time the client sends its next request. (The settlement in `_relay`'s `finally` is then a no-op.)"""
    if state.done and outcome.status != "success":
        outcome.status, outcome.usage = "success", state.billed()
        await settle(outcome)


def new_request_id() -> str:
    return f"gw-{uuid.uuid4().hex}"
