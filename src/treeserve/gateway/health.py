"""Active health checks: every backend's readiness on a fixed interval, `/health/ready` (a
treeserve server turns it 503 as soon as it starts draining for a shutdown, before it goes away),
else `/health`, else `/v1/models`, whichever it has first; a backend that fails is routed around
until it passes again. `model_health` is their verdicts, as LiteLLM's `/health` answers them."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from treeserve.gateway.broker import BrokerClient
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.routing import Backend, Router

log = logging.getLogger("treeserve.gateway")
CHECK_TIMEOUT = 2.0
PROBES = ("/health/ready", "/health", "/v1/models")  # the first a backend does not answer 404 is its probe


async def check(backend: Backend, client: aiohttp.ClientSession, metrics: GatewayMetrics) -> bool:
    headers = {"Authorization": f"Bearer {backend.config.api_key}"} if backend.config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT)
    try:
        for path in (backend.probe,) if backend.probe else PROBES:
            status = await _status(client, backend.endpoint(path), headers, timeout)
            if status != 404:
                backend.probe = path
                break
        healthy = status < 400
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
        healthy = False
    if healthy != backend.healthy:
        log.warning("backend %s is %s", backend.name, "healthy again" if healthy else "failing its health check")
    backend.healthy = healthy
    metrics.backend_up.labels(backend.name).set(int(healthy))
    return healthy


async def _status(client: aiohttp.ClientSession, url: str, headers: dict, timeout: aiohttp.ClientTimeout) -> int:
    async with client.get(url, headers=headers, timeout=timeout) as response:
        await response.read()
        return response.status


async def check_queue(backend: Backend, broker: BrokerClient, metrics: GatewayMetrics) -> bool:
    """A broker backend is healthy while some worker consumes its model's queue; the queue's depth
    and consumers are the load view of that model's workers."""
    try:
        messages, consumers = await broker.queue_state(backend.config.model or backend.model)
    except Exception as exc:  # the broker unreachable: aio-pika raises its own and RuntimeErrors
        log.warning("broker backend %s: %s", backend.name, exc)
        healthy = False
    else:
        backend.queue_depth, backend.consumers = messages, consumers
        metrics.queue_messages.labels(backend.name, backend.model).set(messages)
        metrics.queue_consumers.labels(backend.name, backend.model).set(consumers)
        healthy = consumers > 0
    if healthy != backend.healthy:
        log.warning("broker backend %s (%s) %s", backend.name, backend.model,
                    "has workers again" if healthy else "has no worker")
    backend.healthy = healthy
    metrics.backend_up.labels(backend.name).set(int(healthy))
    return healthy


async def health_loop(router: Router, client: aiohttp.ClientSession, metrics: GatewayMetrics, interval: float,
                      brokers: dict[str, BrokerClient] | None = None) -> None:
    brokers = brokers or {}
    checks = [(check, b, client) if b.url not in brokers else (check_queue, b, brokers[b.url])
              for b in router.backends()]
    while True:
        await asyncio.gather(*(_guarded(job, backend, via, metrics) for job, backend, via in checks))
        await asyncio.sleep(interval)


async def _guarded(job, backend: Backend, via, metrics: GatewayMetrics) -> None:
    """One check whose unexpected error is logged: it never stops the loop, nor the other checks."""
    try:
        await job(backend, via, metrics)
    except Exception:
        log.exception("the health check of backend %s failed", backend.name)


def model_health(router: Router, allows: Callable[[str], bool], model: str | None = None) -> dict:
    """LiteLLM's `/health` answer for a key: each backend of each model it may use, healthy or not
    by the last health check's verdict and its circuit breaker (as LiteLLM's `/health` with
    `background_health_checks`: no request is sent to answer it), an unhealthy one with its last error.
    Given `model` (LiteLLM's `?model=`), the backends it names alone: by the gateway's name or the
    backend's own (LiteLLM's `model_name` or `litellm_params.model`)."""
    healthy, unhealthy = [], []
    for backend in router.backends():
        if allows(backend.model) and model in (None, backend.model, backend.config.model):
            endpoint = {"model": backend.model, "api_base": backend.name}
            if backend.usable:
                healthy.append(endpoint)
            else:
                unhealthy.append(endpoint | {"error": backend.last_error or _why_unusable(backend)})
    return {"healthy_endpoints": healthy, "unhealthy_endpoints": unhealthy, "healthy_count": len(healthy),
            "unhealthy_count": len(unhealthy)}


def _why_unusable(backend: Backend) -> str:
    return "failing its health check" if not backend.healthy else f"circuit breaker {backend.breaker.state}"
