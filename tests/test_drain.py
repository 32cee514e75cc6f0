"""Graceful drain (issue #40): on SIGTERM `treeserve serve` and the gateway turn /health/ready 503
at once, keep /health 200, answer new requests 503 with Retry-After, let the requests in flight
(a stream and a search) run to their end, then exit 0; a second signal exits at once."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway_support import _free_port, wait_for
from treeserve.bench.sse_data import sse_data
from treeserve.gateway.store import Store

TREESERVE = [sys.executable, "-m", "treeserve.cli"]
STREAM_TOKENS = 480  # the tiny models' context is 512


def _start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _wait_ready(url: str, proc: subprocess.Popen, log, timeout: float = 120) -> None:
    def ready():
        if proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            return httpx.get(url + "/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    assert wait_for(ready, timeout=timeout, interval=0.2), log.read_text()[-3000:]


class Stream(threading.Thread):
    """One streamed request read to its end; `first` is set at its first event."""

    def __init__(self, url: str, path: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.headers = url, path, body, headers or {}
        self.first, self.events, self.done_at, self.error = threading.Event(), [], None, None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, headers=self.headers,
                              timeout=120) as response:
                assert response.status_code == 200, response.read()
                for data in sse_data(response.iter_text()):
                    self.events.append(data)
                    self.first.set()
        except Exception as exc:  # (the second-signal test expects the stream cut)
            self.error = exc
        finally:
            self.done_at = time.monotonic()
            self.first.set()

    @property
    def complete(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def tokens(self) -> int:
        usage = [json.loads(e)["usage"] for e in self.events[:-1] if json.loads(e).get("usage")]
        return usage[-1]["completion_tokens"] if usage else 0


class Call(threading.Thread):
    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.response, self.done_at = url, path, body, None, None

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url + self.path, json=self.body, timeout=120)
        finally:
            self.done_at = time.monotonic()


def _long_stream(url: str) -> Stream:
    return Stream(url, "/v1/completions", {"model": "gen", "prompt": "drain", "max_tokens": STREAM_TOKENS,
                                           "min_tokens": STREAM_TOKENS, "n": 8, "stream": True,
                                           "stream_options": {"include_usage": True}})


def _probe_draining(url: str, path: str, body: dict) -> None:
    """What a server or gateway that has begun to drain answers."""
    assert wait_for(lambda: httpx.get(url + "/health/ready", timeout=5).status_code == 503, timeout=10)
    assert httpx.get(url + "/health", timeout=5).status_code == 200  # alive until it exits
    refused = httpx.post(url + path, json=body, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "shutting_down"


@pytest.fixture
def pair_server(pair, tmp_path):
    port, log = _free_port(), tmp_path / "serve.log"
    proc = _start([*TREESERVE, "serve", f"--model=gen={pair['gen']}", f"--model=prm={pair['prm']}", "--port",
                   str(port), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", str(64 << 20),
                   "--shutdown-timeout", "120"], log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@contextlib.contextmanager
def mock_gateway(tmp_path, shutdown_timeout: float = 30):
    """The gateway in front of the mock server (streams of one token each 20 ms); yields
    (url, process, log, database URL, headers)."""
    backend_port, port = _free_port(), _free_port()
    backend = subprocess.Popen([sys.executable, "-m", "treeserve.bench.mock_server", "--port", str(backend_port),
                                "--ttft-ms", "10", "--itl-ms", "20"], stdout=subprocess.DEVNULL)
    database, log = f"sqlite:///{tmp_path / 'gw.db'}", tmp_path / "gateway.log"
    gateway = _start([*TREESERVE, "gateway", "--backend", f"mock=http://127.0.0.1:{backend_port}", "--port", str(port),
                      "--database", database, "--master-key", "sk-master-drain", "--health-interval", "0",
                      "--shutdown-timeout", str(shutdown_timeout)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, gateway, log, timeout=60)
        yield url, gateway, log, database, {"Authorization": "Bearer sk-master-drain"}
    finally:
        for proc in (gateway, backend):
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def _mock_stream(url: str, headers: dict, tokens: int) -> Stream:
    return Stream(url, "/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": tokens, "stream": True}, headers)


def _search_problems(url: str) -> dict[str, float]:
    """The server's search problems by state (running, waiting, finished), by its own metrics."""
    from treeserve.bench.telemetry import parse_prometheus

    metrics = parse_prometheus(httpx.get(url + "/metrics", timeout=5).text)
    return {state: sum(v for k, v in metrics.items() if k.startswith(f"treeserve:search_problems_{state}"))
            for state in ("running", "waiting", "finished")}


def _running(url: str) -> float:
    """The server's requests in its running batch, by its own metrics."""
    from treeserve.bench.telemetry import parse_prometheus

    metrics = parse_prometheus(httpx.get(url + "/metrics", timeout=5).text)
    return sum(v for k, v in metrics.items() if k.startswith("treeserve:num_requests_running"))


def _search_in_flight(url: str) -> bool:
    """The server is running a search problem and has finished none."""
    problems = _search_problems(url)
    return problems["running"] >= 1 and problems["finished"] == 0


def test_serve_finishes_a_stream_and_a_search_then_exits(pair_server):
    url, proc, log = pair_server
    stream = _long_stream(url)
    search = Call(url, "/v1/search", {"model": "gen", "verifier": "prm", "question": "What is 2 + 3?",
                                      "strategy": "beam", "n": 4, "num_iterations": 6, "max_tokens": 128})
    stream.start()
    assert stream.first.wait(60) and stream.error is None, stream.error
    search.start()
    assert wait_for(lambda: _search_in_flight(url), timeout=60, interval=0.05), \
        f"the search was never seen running and unfinished: {_search_problems(url)}"
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _probe_draining(url, "/v1/completions", {"model": "gen", "prompt": "late", "max_tokens": 4})
    probed = time.monotonic()
    stream.join(120)
    search.join(120)
    assert stream.done_at > probed, "the stream ended before the probes: too short to test the drain"
    assert stream.complete and stream.tokens() == 8 * STREAM_TOKENS, stream.events[-3:]
    assert search.done_at > signalled, "the search ended before the signal: it was not in flight"
    assert search.response.status_code == 200, search.response.text
    assert search.response.json()["object"] == "search.result" and search.response.json()["candidates"]
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert "drained" in log.read_text()


def test_serve_ends_what_still_runs_when_its_time_is_up_with_an_error_it_can_read(pair, tmp_path):
    """--shutdown-timeout 0: a stream still running ends with a `shutting_down` error event and
    [DONE], a whole reply still running is a 503 `shutting_down`, and the server exits 0 without a
    traceback (uvicorn cancelled them: clients read `incomplete chunked read`, the log 64 tracebacks)."""
    port, log = _free_port(), tmp_path / "serve.log"
    proc = _start([*TREESERVE, "serve", f"--model=gen={pair['gen']}", "--port", str(port), "--dtype", "float32",
                   "--device", "cpu", "--kv-cache-memory-bytes", str(64 << 20), "--shutdown-timeout", "0"], log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        stream = _long_stream(url)
        whole = Call(url, "/v1/completions", {"model": "gen", "prompt": "whole", "max_tokens": STREAM_TOKENS,
                                              "min_tokens": STREAM_TOKENS, "n": 8})
        stream.start()
        assert stream.first.wait(60) and stream.error is None, stream.error
        whole.start()
        # (the gauge counts sequences: the stream's n=8 alone are 8; one more is the whole reply's)
        assert wait_for(lambda: _running(url) > 8, timeout=60, interval=0.01), "the whole reply never ran"
        proc.send_signal(signal.SIGTERM)  # (at once: on an idle machine the stream ends within ~2 s)
        stream.join(60)
        whole.join(60)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert stream.error is None and stream.events[-1] == "[DONE]", (stream.error, stream.events[-3:])
        assert json.loads(stream.events[-2]).get("error", {}).get("code") == "shutting_down", stream.events[-3:]
        texts = sum(1 for e in stream.events[:-2] if json.loads(e).get("choices"))
        assert 0 < texts < 8 * STREAM_TOKENS  # (cut part way)
        assert whole.response.status_code == 503, whole.response.text
        assert whole.response.json()["error"]["code"] == "shutting_down"
        text = log.read_text()
        assert "Traceback" not in text and "(2 engine stream(s))" in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_a_second_signal_exits_at_once(tmp_path):
    """Shown on the gateway (`serve` takes its signals into the same DrainingServer): the stream in
    flight is cut, the process exits 0 at once, and what the stream got is still billed."""
    with mock_gateway(tmp_path) as (url, gateway, log, database, headers):
        stream = _mock_stream(url, headers, 500)  # 10 s of tokens
        stream.start()
        assert stream.first.wait(30)
        gateway.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(url + "/health/ready", timeout=5).status_code == 503, timeout=10)
        gateway.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert gateway.wait(30) == 0, log.read_text()[-3000:]
        assert time.monotonic() - sent < 5
        stream.join(30)
        assert not stream.complete, "the stream was not cut: the second signal waited for it"
        assert "again: exiting now" in log.read_text()
        rows = Store(database).ledger.spend_logs(limit=10)
        assert len(rows) == 1 and rows[0]["status"] in ("client_closed", "cut"), rows


def test_gateway_finishes_a_relayed_stream_and_bills_it(tmp_path):
    """The gateway in front of the mock server (a stream of 100 tokens, one each 20 ms)."""
    with mock_gateway(tmp_path) as (url, gateway, log, database, headers):
        stream = _mock_stream(url, headers, 100)
        stream.start()
        assert stream.first.wait(30) and stream.error is None, stream.error
        gateway.send_signal(signal.SIGTERM)
        with httpx.Client(headers=headers) as client:
            assert wait_for(lambda: client.get(url + "/health/ready").status_code == 503, timeout=10)
            assert client.get(url + "/health").status_code == 200
            refused = client.post(url + "/v1/chat/completions", json={"model": "mock", "max_tokens": 4,
                                                                     "messages": [{"role": "user", "content": "x"}]})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        probed = time.monotonic()
        stream.join(60)
        assert stream.done_at > probed and stream.complete, stream.events[-3:]
        assert gateway.wait(60) == 0, log.read_text()[-3000:]
        rows = Store(database).ledger.spend_logs(limit=10)
        assert [(r["status"], r["completion_tokens"]) for r in rows] == [("success", 100)], rows


def test_a_stream_still_running_when_the_time_is_up_ends_with_an_error_event_and_is_billed(tmp_path):
    """--shutdown-timeout 1 and a 10 s stream: at the time limit the gateway cuts the stream with an
    error event (`shutting_down`) and [DONE], bills the tokens its client got, and exits 0."""
    with mock_gateway(tmp_path, shutdown_timeout=1) as (url, gateway, log, database, headers):
        stream = _mock_stream(url, headers, 500)
        stream.start()
        assert stream.first.wait(30) and stream.error is None, stream.error
        gateway.send_signal(signal.SIGTERM)
        stream.join(30)
        assert gateway.wait(30) == 0, log.read_text()[-3000:]
        assert stream.error is None and stream.events[-1] == "[DONE]", (stream.error, stream.events[-3:])
        error = json.loads(stream.events[-2])["error"]
        assert error["code"] == "shutting_down", error
        got = sum(1 for e in stream.events[:-2] if json.loads(e).get("choices"))
        assert 0 < got < 500
        rows = Store(database).ledger.spend_logs(limit=10)
        assert [(r["status"], r["completion_tokens"]) for r in rows] == [("cut", got)], rows
        assert "the requests still running were cut" in log.read_text()
