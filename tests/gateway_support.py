"""Test support for the gateway: databases (SQLite, and a throwaway PostgreSQL cluster started with
initdb/pg_ctl as the `postgres` user) and gateways in front of real treeserve servers."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_bin() -> Path | None:
    """The directory of initdb and pg_ctl: Debian keeps them in /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb") and shutil.which("pg_ctl")
    if found:
        return Path(shutil.which("pg_ctl")).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _as_postgres(args: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the `postgres` user there."""
    if os.geteuid() != 0:
        return args
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--", *args]
    return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(args)]


class PostgresCluster:
    def __init__(self, root: Path):
        self.bin = postgres_bin()
        self.data, self.sockets = root / "data", root / "sockets"
        self.port = _free_port()
        self.log = root / "postgres.log"

    def start(self) -> None:
        for path in (self.data, self.sockets):
            path.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(self.data.parent, "postgres")
            for path in (self.data, self.sockets):
                shutil.chown(path, "postgres")
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                   "--no-sync", "-E", "UTF8"])
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                   "-t", "60", "start"])

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def new_database(self) -> str:
        import psycopg

        name = f"gw_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def _run(self, args: list[str]) -> None:
        done = subprocess.run(_as_postgres(args), capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed ({done.returncode}): {done.stderr or done.stdout}")


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


@contextlib.contextmanager
def replicas(model_dir: Path, count: int, api_key: str):
    """`count` real `treeserve serve` processes of one model (served as 'tiny'); yields
    [(url, process)]. Started together, stopped (killed if need be) at the end."""
    import sys

    procs = []
    try:
        for _ in range(count):
            port = _free_port()
            args = [sys.executable, "-m", "treeserve.cli", "serve", str(model_dir), "--served-model-name", "tiny",
                    "--port", str(port), "--api-key", api_key, "--dtype", "float32", "--device", "cpu",
                    "--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs.append((f"http://127.0.0.1:{port}",
                          subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        for url, proc in procs:
            wait_healthy(url, proc, "replica", timeout=120)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def rabbitmq_server() -> str | None:
    for candidate in ("/usr/lib/rabbitmq/bin/rabbitmq-server", shutil.which("rabbitmq-server")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.fixture(scope="session")
def rabbitmq():
    """A throwaway RabbitMQ node on free ports, its files in a temporary directory; yields its AMQP URL."""
    server = rabbitmq_server()
    if server is None:
        pytest.skip("RabbitMQ is not installed: `make test` installs Debian's rabbitmq-server where apt-get is "
                    "available")
    root = Path(tempfile.mkdtemp(prefix="treeserve-rmq-"))
    (root / "enabled_plugins").write_text("[].\n")
    port, dist_port = _free_port(), _free_port()
    env = dict(os.environ, HOME=str(root), RABBITMQ_NODENAME=f"treeserve{port}@localhost",
               RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", RABBITMQ_NODE_PORT=str(port), RABBITMQ_DIST_PORT=str(dist_port),
               RABBITMQ_MNESIA_BASE=str(root / "mnesia"), RABBITMQ_LOG_BASE=str(root / "log"),
               RABBITMQ_ENABLED_PLUGINS_FILE=str(root / "enabled_plugins"),
               RABBITMQ_PLUGINS_EXPAND_DIR=str(root / "plugins"), RABBITMQ_PID_FILE=str(root / "pid"),
               RABBITMQ_CONFIG_FILE=str(root / "rabbitmq"), ERL_EPMD_ADDRESS="127.0.0.1")
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen([server], env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def listening():
        if proc.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited: {(root / 'server.log').read_text()[-2000:]}")
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    try:
        assert wait_for(listening, timeout=90, interval=0.2), "RabbitMQ did not start"
        yield f"amqp://guest:guest@127.0.0.1:{port}/"
    finally:
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


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


def check_answers_and_bills(finished: list[dict], store) -> dict[str, dict]:
    """Every non-streamed request answered whole, every stream whole or cut with an error event;
    one spend row per request, its tokens what the client got. Returns the rows by request id."""
    plain = [r for r in finished if not r["stream"]]
    assert len(plain) == len(finished) // 2 and all(r["usage"]["completion_tokens"] == TOKENS for r in plain)
    assert all(r["usage"]["completion_tokens"] == TOKENS for r in finished if r["stream"] and not r["error"])
    def settled():  # a stream is settled just after its last byte left: its client may be quicker
        store.flush()
        rows = store.spend_logs(limit=10_000)
        return rows if len(rows) >= len(finished) else None
    rows = wait_for(settled, timeout=10) or store.spend_logs(limit=10_000)
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
