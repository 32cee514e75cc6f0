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


class _LoadingEngine:
    """Stands in for the engine loop: once the HTTP server answers, it stops (as a server stopped)."""

    errored = None

    def __init__(self, url: str):
        self.url, self.answered = url, None

    def run_forever(self, should_stop) -> None:
        import httpx

        deadline = time.monotonic() + 30
        while self.answered is None and not should_stop() and time.monotonic() < deadline:
            try:
                self.answered = httpx.get(f"{self.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.05)

    def shutdown(self) -> None:
        pass


def _try_to_take(port: int) -> bool:
    """What another server does (uvicorn's bind: SO_REUSEADDR, then listen); True if it got the port."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            other.bind(("127.0.0.1", port))
            other.listen()
        except OSError:
            return False
        return True


def test_serve_holds_its_port_while_its_models_load(monkeypatch):
    """`treeserve serve` binds its port before the models load and serves on that socket (vLLM's
    way): another server started meanwhile cannot take it (the check let go of the port, and a
    server that took it during a minute of loading left ours to fail with EADDRINUSE after it)."""
    import argparse

    from fastapi import FastAPI

    from treeserve.ports import free_port
    from treeserve.server import launch
    from treeserve.wire.drain import Drain

    port = free_port()
    app = FastAPI()
    app.add_api_route("/health", lambda: {})
    app.state.drain, app.state.engine = Drain(), _LoadingEngine(f"http://127.0.0.1:{port}")
    taken_while_loading = []

    def load(args):
        taken_while_loading.append(_try_to_take(port))
        return app

    monkeypatch.setattr(launch, "_logged_app", load)
    args = argparse.Namespace(host="127.0.0.1", port=port, uvicorn_log_level="warning", disable_uvicorn_access_log=True,
                              enable_log_requests=False, disable_log_stats=True)
    assert launch.serve(args) == 0
    assert taken_while_loading == [False]
    assert app.state.engine.answered == 200  # served on the socket bound before the load
    assert _try_to_take(port)  # and let go of once it stopped


def test_the_gateway_holds_its_port_while_its_app_is_built(monkeypatch, tmp_path):
    from treeserve.cli import main
    from treeserve.ports import free_port

    port, taken_while_building, served_on = free_port(), [], []

    def build(config, store=None):
        taken_while_building.append(_try_to_take(port))
        return "app"

    monkeypatch.setattr("treeserve.gateway.app.build_app", build)
    monkeypatch.setattr("treeserve.gateway.launch.run_gateway",
                        lambda app, host, pt, sockets=None: served_on.append([s.getsockname() for s in sockets]) or 0)
    assert main(["gateway", "--backend", "m=http://127.0.0.1:1", "--port", str(port),
                 "--database", f"sqlite:///{tmp_path / 'g.db'}"]) == 0
    assert taken_while_building == [False] and served_on == [[("127.0.0.1", port)]]


def test_the_gateway_refuses_a_taken_port_before_building_its_app(other_server, monkeypatch, capsys, tmp_path):
    from treeserve.cli import main

    monkeypatch.setattr("treeserve.gateway.app.build_app", lambda config, store=None: pytest.fail("built on a taken port"))
    assert main(["gateway", "--backend", "m=http://127.0.0.1:1", "--port", str(other_server),
                 "--database", f"sqlite:///{tmp_path / 'g.db'}"]) == 2
    err = capsys.readouterr().err
    assert f"treeserve gateway: 127.0.0.1:{other_server} is already in use" in err and "--port" in err


def test_a_port_held_only_by_closed_connections_can_be_bound_again():
    """A port is bound without SO_REUSEADDR to hold it against other servers while the models load,
    and set as it serves: the connections it closed first (TIME_WAIT) do not keep the next start
    from binding it."""
    from treeserve.ports import bind_sockets, closing_all, ready_to_serve

    with closing_all(bind_sockets("127.0.0.1", 0, "--port")) as sockets:
        listener = ready_to_serve(sockets)[0]
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first: its port is left in TIME_WAIT
        client.recv(1)
        client.close()
    with closing_all(bind_sockets("127.0.0.1", port, "--port")) as sockets:
        assert [s.getsockname()[1] for s in sockets] == [port]


def _closed_connections_on(port: int) -> None:
    """`port` left held only by closed connections (TIME_WAIT), as a server stopped a moment ago leaves it."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (uvicorn's)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first
        client.recv(1)
        client.close()


def test_a_port_bound_past_closed_connections_is_held_as_firmly():
    """Bound with SO_REUSEADDR (TIME_WAIT connections were there), the port was shared: a second
    `treeserve serve` bound it too, and another server could bind and listen on it while ours loaded."""
    from treeserve.ports import PortInUseError, bind_sockets, closing_all, free_port

    port = free_port()
    _closed_connections_on(port)
    with closing_all(bind_sockets("127.0.0.1", port, "--port")):
        assert not _try_to_take(port)
        for host in ("127.0.0.1", "0.0.0.0"):
            with pytest.raises(PortInUseError, match=f"{host}:{port} is already in use"):
                bind_sockets(host, port, "--port")


def test_a_failed_start_lets_go_of_its_port(monkeypatch):
    """The models failing to load (an error, or none loaded), `treeserve serve` frees its port."""
    import argparse

    from treeserve.ports import free_port
    from treeserve.server import launch

    port = free_port()
    args = argparse.Namespace(host="127.0.0.1", port=port)
    monkeypatch.setattr(launch, "_logged_app", lambda args: None)
    assert launch.serve(args) == 2
    assert _try_to_take(port)

    def broken(args):
        raise RuntimeError("no weights")

    monkeypatch.setattr(launch, "_logged_app", broken)
    with pytest.raises(RuntimeError, match="no weights"):
        launch.serve(args)
    assert _try_to_take(port)
