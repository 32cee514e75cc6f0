"""The health loop: one check's unexpected error (aiohttp's ValueError for a URL's credentials with
an Authorization header) is logged, and the loop and the other checks go on."""
from __future__ import annotations

import asyncio
import logging

from treeserve.gateway import health
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.routing import Router


def test_one_checks_error_never_stops_the_others(monkeypatch, caplog):
    config = GatewayConfig(models={"m": ModelConfig("m", [BackendConfig("http://bad:1"), BackendConfig("http://good:1")])})
    router = Router(config)
    checked: list[str] = []

    async def status(client, url, headers, timeout):
        checked.append(url)
        if url.startswith("http://bad:1"):
            raise ValueError("Cannot combine AUTHORIZATION header with AUTH argument or credentials encoded in URL")
        return 200

    monkeypatch.setattr(health, "_status", status)

    async def run():
        loop = asyncio.create_task(health.health_loop(router, None, GatewayMetrics(), interval=0.01))
        await asyncio.sleep(0.3)
        assert not loop.done(), loop.exception()
        loop.cancel()

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert sum(u.startswith("http://good:1") for u in checked) > 3
    assert sum(u.startswith("http://bad:1") for u in checked) > 3  # checked again each round
    assert any("health check of backend http://bad:1 failed" in r.getMessage() for r in caplog.records)
