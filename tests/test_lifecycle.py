"""Every long-running command (`serve`, `gateway`, `worker`, `chat`, `bench sweep`) stopped by
SIGTERM (as a service manager stops it), SIGINT (Ctrl-C) or SIGKILL leaves no process behind
(issue #40): SIGTERM and SIGINT run its cleanup and exit 0; on SIGKILL its children notice their
parent's death (a parent-death signal, or a watched parent pid) and stop themselves.

Each test starts the command three times at once (startup is most of the cost) and sends one of
the three signals to each; every process found under each one before the signal must be gone."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from gateway_support import _free_port, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")

EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 0, signal.SIGKILL: -signal.SIGKILL}
SIGNALS = list(EXIT_STATUS)
TREESERVE = [sys.executable, "-m", "treeserve.cli"]


def _start(args: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=cwd,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], ready, timeout: float = 300) -> None:
    """Until `ready(i)` holds for every process; fails with a log if one exits first."""
    def all_ready() -> bool:
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                pytest.fail(f"{' '.join(proc.args[2:5])} exited ({proc.returncode}): {logs[i].read_text()[-3000:]}")
        return all(ready(i) for i in range(len(procs)))
    assert wait_for(all_ready, timeout=timeout, interval=0.3), "the commands did not come up"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def signal_each_and_check(procs: list[subprocess.Popen], logs: list[Path], children: int = 0) -> None:
    """SIGTERM, SIGINT and SIGKILL, one to each of the three; each exits with its status (0, 0,
    killed) and every process that was under it (at least `children` of them) is gone."""
    families = [psutil.Process(p.pid).children(recursive=True) for p in procs]
    for family in families:
        assert len(family) >= children, [p.cmdline() for p in family]
    for proc, sig in zip(procs, SIGNALS):
        proc.send_signal(sig)
    for proc, sig, family, log in zip(procs, SIGNALS, families, logs):
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 120 s after {sig.name}: {log.read_text()[-3000:]}")
        assert code == EXIT_STATUS[sig], f"{sig.name}: exit status {code}: {log.read_text()[-3000:]}"
        left = wait_for(lambda: not any(_alive(p) for p in family), timeout=60)
        assert left, f"after {sig.name}, left behind: {[p.cmdline() for p in family if _alive(p)]}"


def assert_heap_frozen(logs: list[Path]) -> None:
    """Each server froze its startup heap once its engines were built (lifecycle.freeze_startup_heap):
    the modules, tokenizer and engines' objects, tens of thousands of them, that no full collection
    walks again."""
    for log in logs:
        found = re.findall(r"startup heap frozen: (\d+) objects", log.read_text())
        assert len(found) == 1 and int(found[0]) > 20_000, (found, log.read_text()[-2000:])


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_serve_with_tensor_parallel_ranks(llama_dir, tmp_path):
    ports = [_free_port() for _ in SIGNALS]
    logs = [tmp_path / f"serve{i}.log" for i in range(len(SIGNALS))]
    procs = [_start([*TREESERVE, "serve", str(llama_dir), "--port", str(port), "--dtype", "float32", "--device",
                     "cpu", "--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "256",
                     "--tensor-parallel-size", "2", "--threads-per-rank", "1"], log)
             for port, log in zip(ports, logs)]
    try:
        _wait_all(procs, logs, lambda i: _answers(f"http://127.0.0.1:{ports[i]}/health/ready"))
        assert_heap_frozen(logs)
        signal_each_and_check(procs, logs, children=1)  # rank 1 (and multiprocessing's helper)
    finally:
        _stop(procs)


def test_gateway(tmp_path):
    ports = [_free_port() for _ in SIGNALS]
    logs = [tmp_path / f"gateway{i}.log" for i in range(len(SIGNALS))]
    procs = [_start([*TREESERVE, "gateway", "--backend", "tiny=http://127.0.0.1:9", "--health-interval", "0",
                     "--port", str(port), "--database", f"sqlite:///{tmp_path / f'gw{port}.db'}"], log)
             for port, log in zip(ports, logs)]
    try:
        _wait_all(procs, logs, lambda i: _answers(f"http://127.0.0.1:{ports[i]}/health/ready"), timeout=60)
        assert_heap_frozen(logs)
        signal_each_and_check(procs, logs)
    finally:
        _stop(procs)


def test_worker(llama_dir, tmp_path, rabbitmq):
    import aio_pika

    logs = [tmp_path / f"worker{i}.log" for i in range(len(SIGNALS))]
    procs = [_start([*TREESERVE, "worker", str(llama_dir), "--served-model-name", "lifecycle", "--broker", rabbitmq,
                     "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                     "--kv-cache-memory-bytes", str(32 << 20)], log) for log in logs]

    async def consumers() -> int:
        async with await aio_pika.connect(rabbitmq) as connection:
            queue = await (await connection.channel()).declare_queue("treeserve.model.lifecycle", durable=True)
            return queue.declaration_result.consumer_count
    try:
        _wait_all(procs, logs, lambda i: i or asyncio.run(consumers()) == len(procs))
        assert_heap_frozen(logs)
        signal_each_and_check(procs, logs)
        assert asyncio.run(consumers()) == 0
    finally:
        _stop(procs)


def test_bench_sweep(tmp_path):
    """The sweep's server (here the mock server) runs in its own process group: it must still end
    when the sweep is killed."""
    ports = [_free_port() for _ in SIGNALS]
    logs = [tmp_path / f"sweep{i}.log" for i in range(len(SIGNALS))]
    procs = []
    for i, port in enumerate(ports):
        command = [sys.executable, "-m", "treeserve.bench.mock_server", "--port", str(port), "--ttft-ms", "10",
                   "--itl-ms", "20"]
        sweep = {"out": str(tmp_path / f"out{i}"),
                 "bench": {"num_requests": 10_000, "input_len": 8, "output_len": 50, "vocab_size": 1000,
                           "model": "mock", "telemetry_interval": 0.5},
                 "servers": [{"name": "mock", "command": command, "base_url": f"http://127.0.0.1:{port}"}]}
        (tmp_path / f"sweep{i}.yaml").write_text(yaml.safe_dump(sweep))
        procs.append(_start([*TREESERVE, "bench", "sweep", str(tmp_path / f"sweep{i}.yaml")], logs[i]))
    try:
        # under way: the server answers (the sweep waits for that too) and its benchmark has begun
        _wait_all(procs, logs, lambda i: _answers(f"http://127.0.0.1:{ports[i]}/health"), timeout=120)
        time.sleep(1.0)
        signal_each_and_check(procs, logs, children=1)
    finally:
        _stop(procs)


def test_chat(tmp_path):
    """`treeserve chat` runs `treeserve serve` as its child (its first report: SIGTERM left it running).
    A fourth one whose model server dies exits 1, saying so (it kept serving 503s)."""
    ports = [(_free_port(), _free_port()) for _ in range(len(SIGNALS) + 1)]
    logs = [tmp_path / f"chat{i}.log" for i in range(len(ports))]
    procs = [_start([*TREESERVE, "chat", "--port", str(port), "--serve-port", str(serve_port),
                     "--database", f"sqlite:///{tmp_path / f'chat{port}.db'}"], log, cwd=tmp_path)
             for (port, serve_port), log in zip(ports, logs)]
    try:
        _wait_all(procs, logs, lambda i: _answers(f"http://127.0.0.1:{ports[i][0]}/health/ready"), timeout=600)
        orphaned, = psutil.Process(procs[-1].pid).children()
        orphaned.kill()
        signal_each_and_check(procs[:-1], logs[:-1], children=1)
        assert procs[-1].wait(60) == 1
        assert "the model server (pid" in logs[-1].read_text() and "exited with status -9" in logs[-1].read_text()
    finally:
        _stop(procs)

