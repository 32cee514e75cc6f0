"""The gateway's connections to its backends: one aiohttp session for the HTTP ones and a broker
client for each amqp:// URL. Made with the app, opened at its startup (an aiohttp session belongs to
the running event loop), closed at its shutdown."""
from __future__ import annotations

import json

import aiohttp

from treeserve.gateway.broker import BrokerClient
from treeserve.gateway.config import BROKER_SCHEMES
from treeserve.gateway.routing import Router


class Upstreams:
    def __init__(self, router: Router):
        self.brokers = {b.url: BrokerClient(b.url) for b in router.backends() if b.url.startswith(BROKER_SCHEMES)}
        self._client: aiohttp.ClientSession | None = None

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("the gateway's upstream connections are not open: its app has not started")
        return self._client

    async def open(self) -> None:
        # aiohttp for the upstream side: its C parser reads a stream at a fraction of httpx's cost per chunk
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)  # under uvicorn's 5 s keep-alive
        self._client = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                             json_serialize=json.dumps)
        for broker in self.brokers.values():
            await broker.start()

    async def close(self) -> None:
        try:
            if self._client is not None:
                await self._client.close()
        finally:
            for broker in self.brokers.values():
                await broker.close()
