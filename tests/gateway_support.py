"""Test support for the gateway: databases (SQLite, and a throwaway PostgreSQL cluster started with
initdb/pg_ctl as the `postgres` user), a throwaway RabbitMQ node (both from treeserve.bench.services),
and gateways in front of real treeserve servers."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from treeserve.bench.services import PostgresCluster, RabbitNode, free_port, postgres_bin, rabbitmq_server


def _free_port() -> int:
    """A free port below the kernel's ephemeral range, where nothing else is handed one: a port the kernel
    picked could go to another process's connection or gloo listener before the server bound it (a
    tensor-parallel serve test found its port taken 16 s later, while a sibling's ranks started)."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(10000, max(low, 10001))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


@pytest.fixture(scope="session")
def postgres():
    if postgres_bin() is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) are not installed: `make test` installs Debian's "
                    "postgresql package where apt-get is available")
    if os.geteuid() == 0 and subprocess.run(["id", "postgres"], capture_output=True).returncode != 0:
        pytest.skip("running as root without a `postgres` user to run PostgreSQL as")
    root = Path(tempfile.mkdtemp(prefix="treeserve-pg-"))  # not under pytest's root-only tmp: postgres reads it
    cluster = PostgresCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    """A gateway database URL: a SQLite file, then a new database of the `postgres` cluster."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gateway.db'}"
    return request.getfixturevalue("postgres").new_database()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float) -> None:
    """Until `url`/health answers 200; fails with the process's last words if it exits first."""
    import httpx

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} {url} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_for(up, timeout=timeout, interval=0.1), f"{what} {url} did not start"


def start_replica(model_dir: Path, port: int, api_key: str, log: Path | None = None,
                  nice: int = 0) -> subprocess.Popen:
    """One `treeserve serve` of the model (served as 'tiny') on `port`; its log piped (a short run's)
    or written to `log` (a long run's: a full pipe would stall the server); `nice` lowers its priority."""
    import sys

    args = [sys.executable, "-m", "treeserve.cli", "serve", str(model_dir), "--served-model-name", "tiny",
            "--port", str(port), "--api-key", api_key, "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20)]
    return subprocess.Popen(args, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=open(log, "ab") if log else subprocess.PIPE,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


@contextlib.contextmanager
def replicas(model_dir: Path, count: int, api_key: str):
    """`count` real `treeserve serve` processes of one model (served as 'tiny'); yields
    [(url, process)]. Started together, stopped (killed if need be) at the end."""
    procs = []
    try:
        for _ in range(count):
            port = _free_port()
            procs.append((f"http://127.0.0.1:{port}", start_replica(model_dir, port, api_key)))
        for url, proc in procs:
            wait_healthy(url, proc, "replica", timeout=120)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@contextlib.contextmanager
def rabbit_node():
    """A throwaway RabbitMQ node on free ports, its files in a temporary directory (stopped with
    SIGKILL at the end: a test may have killed it already)."""
    if rabbitmq_server() is None:
        pytest.skip("RabbitMQ is not installed: `make test` installs Debian's rabbitmq-server where apt-get is "
                    "available")
    root = Path(tempfile.mkdtemp(prefix="treeserve-rmq-"))
    node = RabbitNode(root)
    try:
        node.start()
        yield node
    finally:
        node.stop(signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def rabbitmq():
    """A RabbitMQ node for the session; yields its AMQP URL."""
    with rabbit_node() as node:
        yield node.url


@contextlib.contextmanager
def workers(model_dir: Path, count: int, broker_url: str, api_key: str):
    """`count` `treeserve worker` processes of one model (served as 'tiny'); yields their processes
    once each consumes the model's queue."""
    import asyncio
    import sys

    import aio_pika

    procs = []
    try:
        for _ in range(count):
            args = [sys.executable, "-m", "treeserve.cli", "worker", str(model_dir), "--served-model-name", "tiny",
                    "--broker", broker_url, "--api-key", api_key, "--dtype", "float32", "--device", "cpu",
                    "--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20)]
            procs.append(subprocess.Popen(args, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

        async def consumers() -> int:
            async with await aio_pika.connect(broker_url) as connection:
                channel = await connection.channel()
                queue = await channel.declare_queue("treeserve.model.tiny", durable=True)
                return queue.declaration_result.consumer_count

        def ready():
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited: {proc.stderr.read().decode()[-2000:]}")
            return asyncio.run(consumers()) == count

        assert wait_for(ready, timeout=120, interval=0.5), "the workers did not start consuming"
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


TOKENS = 48  # every answer in the kill tests is this long (min_tokens)


def chat_request(client, i: int) -> dict:
    """Request i with the official client: even ones whole, odd ones streamed with usage in every
    chunk (so a cut stream's client knows how many tokens it got). Returns what the client saw."""
    import openai

    messages = [{"role": "user", "content": f"Request number {i}: tell me something"}]
    extra = {"min_tokens": TOKENS}
    if i % 2 == 0:
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=TOKENS,
                                                                extra_body=extra)
        answer = raw.parse()
        return {"i": i, "stream": False, "id": raw.headers["x-request-id"], "usage": answer.usage.model_dump()}
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=TOKENS, stream=True, extra_body=extra,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    result = {"i": i, "stream": True, "id": raw.headers["x-request-id"], "usage": None, "error": None}
    try:
        for chunk in raw.parse():
            if chunk.usage is not None:
                result["usage"] = chunk.usage.model_dump()
    except openai.APIError as exc:  # the gateway's error event after a backend broke off
        result["error"] = str(exc)
    return result


def retries_total(app) -> float:
    """The gateway's `retries_total`: attempts moved to another backend (or tried again)."""
    return sum(sample.value for metric in app.state.metrics.retries.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


def run_and_kill(client, count: int, kill, after: int) -> list[dict]:
    """`count` requests 8 at a time; `kill()` once `after` of them have finished."""
    import concurrent.futures
    import threading

    finished: list[dict] = []

    def killer():
        wait_for(lambda: len(finished) >= after, timeout=120)
        kill()

    thread = threading.Thread(target=killer)
    thread.start()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(chat_request, client, i) for i in range(count)]
        for future in concurrent.futures.as_completed(futures, timeout=240):
            finished.append(future.result())
    thread.join()
    return finished


def check_answers_and_bills(finished: list[dict], ledger) -> dict[str, dict]:
    """Every non-streamed request answered whole, every stream whole or cut with an error event;
    one spend row per request, its tokens what the client got. Returns the rows by request id."""
    plain = [r for r in finished if not r["stream"]]
    assert len(plain) == len(finished) // 2 and all(r["usage"]["completion_tokens"] == TOKENS for r in plain)
    assert all(r["usage"]["completion_tokens"] == TOKENS for r in finished if r["stream"] and not r["error"])
    def settled():  # a stream is settled just after its last byte left: its client may be quicker
        ledger.flush()
        rows = ledger.spend_logs(limit=10_000)
        return rows if len(rows) >= len(finished) else None
    rows = wait_for(settled, timeout=10) or ledger.spend_logs(limit=10_000)
    logs = {row["request_id"]: row for row in rows}
    assert len(rows) == len(finished) == len(logs)  # one answer each: none lost, none twice
    for r in finished:
        got = r["usage"] or {"prompt_tokens": 0, "completion_tokens": 0}
        row = logs[r["id"]]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (got["prompt_tokens"], got["completion_tokens"]), \
            (r, row)
        assert row["status"] == ("cut" if r.get("error") else "success"), (r, row)
    return logs


@contextlib.contextmanager
def gateway_processes(count: int, database: str, backend: str, backend_key: str, master_key: str,
                      price_out: float):
    """`count` real `treeserve gateway` processes on one database, serving the model 'tiny' of
    `backend`; yields their URLs."""
    import sys

    import yaml

    root = Path(tempfile.mkdtemp(prefix="treeserve-gw-"))
    config = root / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "master_key": master_key, "database": database, "health_interval": 0,
        "models": {"tiny": {"backends": [{"url": backend, "api_key": backend_key}],
                            "output_cost_per_token": price_out, "max_tokens": 64}}}))
    procs, urls = [], []
    try:
        for _ in range(count):
            port = _free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(subprocess.Popen([sys.executable, "-m", "treeserve.cli", "gateway", "--config", str(config),
                                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc, "gateway", timeout=60)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)
