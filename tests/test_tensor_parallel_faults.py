"""A tensor-parallel worker that dies: a server idling on it turns /health 503 naming the rank;
`treeserve serve --tensor-parallel-size 2` exits and leaves no process behind."""
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from conftest import API_KEY, _free_port, running_server
from test_server_tensor_parallel import TP_OPTIONS


def test_a_dead_worker_turns_health_503(llama_dir):
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], **TP_OPTIONS)
    engine = app.state.engine.engine
    try:
        with running_server(app) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            os.kill(engine.executor.pids()[0], signal.SIGKILL)
            deadline, status = time.monotonic() + 10, 200
            while status == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
                status = httpx.get(f"{url}/health").status_code
            body = httpx.get(f"{url}/health").json()
            assert status == 503 and "rank 1" in body["error"]["message"]
    finally:
        engine.close()


def test_the_served_command_exits_when_a_worker_dies_and_leaves_nothing(llama_dir):
    port = _free_port()
    command = [sys.executable, "-m", "treeserve.cli", "serve", str(llama_dir), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", str(32 << 20),
               "--max-model-len", "512", "--tensor-parallel-size", "2", "--threads-per-rank", "1"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        workers = psutil.Process(server.pid).children(recursive=True)
        ranks = [p for p in workers if "tp_worker" in " ".join(p.cmdline()) or "spawn" in " ".join(p.cmdline())]
        assert ranks, f"no worker process under the server: {[p.cmdline() for p in workers]}"
        ranks[0].kill()
        code = server.wait(timeout=15)
        assert code != 0
        assert "rank 1" in server.stdout.read()
        time.sleep(1)
        assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
