"""Ports of the commands that start servers: a taken port is an error naming it and its flag before
anything slow starts (`treeserve serve` before loading its models; `treeserve chat` before starting
its model server, which takes a free port unless --serve-port names one); and the chat waits for its
own server (the models it serves), never for whatever else answers /health on that port."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from treeserve.bench.health import wait_healthy

CHAT = [sys.executable, "-m", "treeserve.cli", "chat"]


class OtherServer(BaseHTTPRequestHandler):
    """Another OpenAI-compatible server: healthy, serving other models."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = {"/health": {}, "/v1/models": {"data": [{"id": "arith-gen"}, {"id": "arith-prm"}]}}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def other_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), OtherServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("flag", ["--serve-port", "--port"])
def test_a_taken_port_is_an_error_naming_it_and_its_flag(other_server, flag, tmp_path):
    started = time.monotonic()
    done = subprocess.run([*CHAT, flag, str(other_server), "--database", f"sqlite:///{tmp_path / 'chat.db'}"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"127.0.0.1:{other_server} is already in use" in done.stderr and flag in done.stderr, done.stderr
    assert "password" not in done.stdout  # nothing printed as if it had started
    assert time.monotonic() - started < 30  # refused before any model server was started


def test_serve_refuses_a_taken_port_before_loading_its_models(other_server):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "treeserve.cli", "serve", "--port", str(other_server)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"127.0.0.1:{other_server} is already in use" in done.stderr, done.stderr
    assert "--port" in done.stderr and "engine ready" not in done.stderr
    assert time.monotonic() - started < 30


def test_waiting_for_the_server_started_not_another_on_its_port(other_server):
    url = f"http://127.0.0.1:{other_server}"
    wait_healthy(url, None, timeout=5, models=["arith-gen"])  # the models it serves: it is the one
    with pytest.raises(TimeoutError, match="arith-router in /v1/models"):
        wait_healthy(url, None, timeout=1, models=["arith-gen", "arith-router"])


def test_waiting_ends_when_the_started_server_exits(other_server):
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        wait_healthy(f"http://127.0.0.1:{other_server}", dead, timeout=5, models=["arith-router"])


def test_help_shows_the_defaults():
    done = subprocess.run([*CHAT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "(default: 4000)" in text and "default: a free one" in text and "(default: demo)" in text


def test_the_port_check_counts_a_listener_not_closed_connections():
    from treeserve.ports import PortInUseError, ensure_port_free, free_port

    port = free_port()
    ensure_port_free("127.0.0.1", port, "--port")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port} is already in use.*--port"):
            ensure_port_free("127.0.0.1", port, "--port")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")


@needs_ipv6
@pytest.mark.parametrize("host", ["::", "::1"])
def test_an_ipv6_host_is_checked_as_ipv6(host):
    """(`--host ::` was refused as "already in use (Address family for hostname not supported)")"""
    from treeserve.ports import PortInUseError, ensure_port_free, free_port

    port = free_port("::1")
    ensure_port_free(host, port, "--port")
    with socket.socket(socket.AF_INET6) as listener:
        listener.bind(("::1", port))
        listener.listen()
        with pytest.raises(PortInUseError, match=rf"\[{host}\]:{port} is already in use.*--port"):
            ensure_port_free(host, port, "--port")


@pytest.mark.parametrize("host, reason", [("192.0.2.1", "Cannot assign requested address"),
                                          ("no-such-host.invalid", "")])
def test_a_bind_failure_other_than_a_taken_port_is_not_called_in_use(host, reason):
    from treeserve.ports import PortInUseError, PortUnavailableError, ensure_port_free, free_port

    port = free_port()
    with pytest.raises(PortUnavailableError, match=f"cannot listen on {host}:{port} \\({reason}") as raised:
        ensure_port_free(host, port, "--port")
    assert not isinstance(raised.value, PortInUseError) and "in use" not in str(raised.value)


@needs_ipv6
def test_serve_on_ipv6_refuses_a_taken_port_in_one_line():
    from treeserve.ports import free_port

    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as listener:
        listener.bind(("::1", port))
        listener.listen()
        done = subprocess.run([sys.executable, "-m", "treeserve.cli", "serve", "--host", "::1", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"treeserve serve: [::1]:{port} is already in use (Address already in use): stop what listens there or "
        "pass another --port"], done.stderr
