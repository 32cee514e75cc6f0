"""A rolling restart (issue #40; README, "Rolling restart"): two real `treeserve serve` replicas
behind the gateway under load at concurrency 32; each in turn gets SIGTERM (it drains: its
/health/ready turns 503, so the gateway's health check routes around it, and a request that still
reaches it gets 503 and is retried on the other replica), exits 0, and is started again on its
port. No request fails, every stream ends with [DONE], and every request is billed once."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest
import yaml

from conftest import API_KEY
from gateway_support import _free_port, start_replica, wait_for
from treeserve.bench.sse_data import asse_data
from treeserve.gateway.store import Store

MASTER = "sk-master-rolling"
PRICE_OUT = 1e-4
CONCURRENCY, TOKENS = 32, 16
# The load (the clients, the gateway, the replicas first started) runs at a lower priority than a
# replica starting again, which would otherwise take 15 s to start on two busy cores.
LOAD_NICE = 10


class Load(threading.Thread):
    """CONCURRENCY clients, each sending requests (every other one streamed) until stopped."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.results: list[dict] = []

    def run(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICE)  # this thread only
        asyncio.run(self._main())

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY)
        headers = {"Authorization": f"Bearer {MASTER}"}
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._client(client, c) for c in range(CONCURRENCY)))

    async def _client(self, client: httpx.AsyncClient, c: int) -> None:
        i = 0
        while not self.stop.is_set():
            stream = i % 2 == 1
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"client {c} request {i}"}],
                    "max_tokens": TOKENS, "min_tokens": TOKENS, "stream": stream}
            began = time.monotonic()
            try:
                result = await (self._stream(client, body) if stream else self._whole(client, body))
            except httpx.HTTPError as exc:
                result = {"ok": False, "error": repr(exc)}
            self.results.append({**result, "stream": stream, "began": began})
            i += 1

    async def _whole(self, client: httpx.AsyncClient, body: dict) -> dict:
        response = await client.post("/v1/chat/completions", json=body)
        ok = response.status_code == 200 and response.json()["usage"]["completion_tokens"] == TOKENS
        return {"ok": ok, "id": response.headers.get("x-request-id"), "error": None if ok else response.text}

    async def _stream(self, client: httpx.AsyncClient, body: dict) -> dict:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "error": (await response.aread()).decode()}
            events = [data async for data in asse_data(response.aiter_text())]
        errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
        ok = bool(events) and events[-1] == "[DONE]" and not errors
        return {"ok": ok, "id": response.headers.get("x-request-id"), "error": errors or (None if ok else events[-2:])}


def test_rolling_restart_of_two_replicas_under_load(llama_dir, tmp_path):
    ports, gateway_port = [_free_port(), _free_port()], _free_port()
    urls, gateway = [f"http://127.0.0.1:{port}" for port in ports], f"http://127.0.0.1:{gateway_port}"
    logs = [tmp_path / f"replica{i}.log" for i in range(2)]
    database = f"sqlite:///{tmp_path / 'gw.db'}"
    procs = [start_replica(llama_dir, port, API_KEY, log, nice=LOAD_NICE) for port, log in zip(ports, logs)]
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "master_key": MASTER, "database": database, "routing": "round_robin", "health_interval": 0.5,
        "breaker_cooldown": 1.0,
        "models": {"tiny": {"backends": [{"url": url, "api_key": API_KEY} for url in urls],
                            "output_cost_per_token": PRICE_OUT}}}))
    gateway_log = tmp_path / "gateway.log"
    procs.append(subprocess.Popen([sys.executable, "-m", "treeserve.cli", "gateway", "--config", str(config),
                                   "--port", str(gateway_port)], stdout=subprocess.DEVNULL,
                                  stderr=open(gateway_log, "wb"), preexec_fn=lambda: os.nice(LOAD_NICE)))
    try:
        for url, proc, log in zip([*urls, gateway], procs, [*logs, gateway_log]):
            _wait_ready(url, proc, log)
        load = Load(gateway)
        load.start()
        assert wait_for(lambda: len(load.results) >= 100, timeout=60), "the load did not get going"
        began, marks = time.monotonic(), []
        for i in range(2):
            procs[i].send_signal(signal.SIGTERM)
            assert procs[i].wait(60) == 0, logs[i].read_text()[-3000:]
            marks.append((f"replica {i} exited", time.monotonic()))
            procs[i] = start_replica(llama_dir, ports[i], API_KEY, logs[i])
            _wait_ready(urls[i], procs[i], logs[i])
            assert wait_for(lambda: _usable(gateway, urls[i]), timeout=30), _backends(gateway)
            marks.append((f"replica {i} back", time.monotonic()))
        count = len(load.results)
        assert wait_for(lambda: len(load.results) >= count + 100, timeout=60)
        load.stop.set()
        load.join(60)
        assert not load.is_alive()
        failed = [{**r, "began": round(r["began"] - began, 2)} for r in load.results if not r["ok"]]
        assert not failed, (f"{len(failed)} of {len(load.results)} failed: {failed[:5]}; "
                            f"{[(m, round(t - began, 2)) for m, t in marks]}")
        retries = _retries(gateway)
        procs[2].send_signal(signal.SIGTERM)  # the gateway drains and writes its spend logs
        assert procs[2].wait(60) == 0, gateway_log.read_text()[-3000:]
        logs = Store(database).ledger.spend_logs(limit=100_000)
        ids = [r["id"] for r in load.results]
        shared = [i for i, n in Counter(ids).items() if i is None or n > 1]
        assert not shared, f"request ids missing or shared by several requests: {shared[:5]}"
        billed = Counter(row["request_id"] for row in logs)
        not_once = {i: n for i, n in billed.items() if n != 1} | {i: 0 for i in ids if i not in billed}
        assert not not_once, f"requests not billed exactly once (id: rows): {dict(list(not_once.items())[:5])}"
        assert set(billed) == set(ids), f"rows for requests the load never sent: {sorted(set(billed) - set(ids))[:5]}"
        assert len(logs) == len(load.results)
        assert all(row["cost"] == pytest.approx(TOKENS * PRICE_OUT) for row in logs), "a request billed twice over"
        rows = {row["request_id"]: row for row in logs}
        assert len(rows) == len(load.results)
        assert all(rows[r["id"]]["status"] == "success" and rows[r["id"]]["completion_tokens"] == TOKENS
                   for r in load.results)
        last_back = marks[-1][1]
        after = {rows[r["id"]]["backend"] for r in load.results if r["began"] > last_back}
        assert after == set(urls), f"after the restarts only {after} answered"
        print(json.dumps({"requests": len(load.results), "streams": sum(r["stream"] for r in load.results),
                          "failed": len(failed), "retries": retries,
                          "marks": [(m, round(t - began, 1)) for m, t in marks]}))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def _backends(gateway: str) -> list[dict]:
    return httpx.get(gateway + "/health/backends", headers={"Authorization": f"Bearer {MASTER}"}, timeout=10).json()


def _usable(gateway: str, url: str) -> bool:
    return any(b["url"] == url and b["healthy"] and b["circuit"] != "open" for b in _backends(gateway))


def _retries(gateway: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gateway + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}, timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "treeserve_gateway:retries_total")

def _wait_ready(url: str, proc, log) -> None:
    def ready():
        assert proc.poll() is None, log.read_text()[-3000:]  # (the gateway's probe answers too)
        try:
            return httpx.get(url + "/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    assert wait_for(ready, timeout=120, interval=0.2), log.read_text()[-3000:]

