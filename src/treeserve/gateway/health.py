"""Active health checks: every backend's `/health` (or `/v1/models` where there is none) on a
fixed interval; a backend that fails is routed around until it passes again."""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from treeserve.gateway.config import HTTP_SCHEMES
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.routing import Backend, Router

log = logging.getLogger("treeserve.gateway")
CHECK_TIMEOUT = 2.0


async def check(backend: Backend, client: aiohttp.ClientSession, metrics: GatewayMetrics) -> bool:
    headers = {"Authorization": f"Bearer {backend.config.api_key}"} if backend.config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT)
    try:
        status = await _status(client, backend.url + "/health", headers, timeout)
        if status == 404:
            status = await _status(client, backend.url + "/v1/models", headers, timeout)
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


async def health_loop(router: Router, client: aiohttp.ClientSession, metrics: GatewayMetrics, interval: float) -> None:
    backends = [b for b in router.backends() if b.url.startswith(HTTP_SCHEMES)]  # workers have no /health
    while True:
        await asyncio.gather(*(check(b, client, metrics) for b in backends))
        await asyncio.sleep(interval)
