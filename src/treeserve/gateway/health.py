"""Active health checks: every backend's `/health` (or `/v1/models` where there is none) on a
fixed interval; a backend that fails is routed around until it passes again."""
from __future__ import annotations

import asyncio
import logging

import httpx

from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.routing import Backend, Router

log = logging.getLogger("treeserve.gateway")
CHECK_TIMEOUT = 2.0


async def check(backend: Backend, client: httpx.AsyncClient, metrics: GatewayMetrics) -> bool:
    headers = {"Authorization": f"Bearer {backend.config.api_key}"} if backend.config.api_key else {}
    try:
        response = await client.get(backend.url + "/health", headers=headers, timeout=CHECK_TIMEOUT)
        if response.status_code == 404:
            response = await client.get(backend.url + "/v1/models", headers=headers, timeout=CHECK_TIMEOUT)
        healthy = response.status_code < 400
    except httpx.HTTPError:
        healthy = False
    if healthy != backend.healthy:
        log.warning("backend %s is %s", backend.url, "healthy again" if healthy else "failing its health check")
    backend.healthy = healthy
    metrics.backend_up.labels(backend.url).set(int(healthy))
    return healthy


async def health_loop(router: Router, client: httpx.AsyncClient, metrics: GatewayMetrics, interval: float) -> None:
    while True:
        await asyncio.gather(*(check(b, client, metrics) for b in router.backends()))
        await asyncio.sleep(interval)
