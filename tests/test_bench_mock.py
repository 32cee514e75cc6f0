"""The benchmark client against the mock server, whose true TTFT and ITL are known."""
import socket
import sys
from pathlib import Path

import pytest
import yaml

from treeserve.bench import mock_server
from treeserve.bench.overhead import calibrate
from treeserve.cli import main

TRUE_TTFT_MS, TRUE_ITL_MS = 500.0, 50.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timing  # (the mock keeps its 50 ms only on a core of its own: 82 ms beside a torch worker)
def test_reported_ttft_and_itl_within_5_percent_at_64_streams(tmp_path):
    result = calibrate(tmp_path / "run", free_port(), ttft_ms=TRUE_TTFT_MS, itl_ms=TRUE_ITL_MS,
                       concurrency=64, num_requests=128, output_len=10)
    assert result["measured_ttft_ms"] == pytest.approx(TRUE_TTFT_MS, rel=0.05)
    assert result["measured_itl_ms"] == pytest.approx(TRUE_ITL_MS, rel=0.05)
    assert result["event_loop_lag_ms"]["count"] > 0  # the client's own overhead was measured
    import json

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    level = summary["levels"][0]
    assert level["completed"] == 128 and level["concurrency"] == 64
    assert level["ttft_ms"]["median"] == pytest.approx(TRUE_TTFT_MS, rel=0.05)
    assert level["itl_ms"]["median"] == pytest.approx(TRUE_ITL_MS, rel=0.05)
    assert level["tpot_ms"]["mean"] == pytest.approx(TRUE_ITL_MS, rel=0.05)  # one token per chunk here
    assert level["server"]["generation_tokens"] == 1280  # the mock's own counter, scraped around the level


@pytest.fixture(scope="module")
def mock_url():
    from treeserve.bench.overhead import running_mock_server

    with running_mock_server(free_port(), ttft_ms=40, itl_ms=10) as url:
        yield url


def test_request_rate_and_duration_limit(mock_url, tmp_path):
    from treeserve.bench.run import BenchConfig, run_benchmark

    config = BenchConfig(base_url=mock_url, out=str(tmp_path), request_rate=[20.0], num_requests=1000,
                         duration=1.0, input_len=[8], output_len=[3], plots=False, seed=1)
    level = run_benchmark(config)["levels"][0]
    assert level["concurrency"] is None and level["request_rate"] == 20.0
    assert 8 <= level["requests"] <= 35  # about 20 arrivals in the 1 s window, nowhere near 1000
    assert level["completed"] == level["requests"]


def test_chat_without_streaming(mock_url, tmp_path):
    from treeserve.bench.run import BenchConfig, run_benchmark

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "there"}\n')
    config = BenchConfig(base_url=mock_url, out=str(tmp_path / "run"), endpoint="chat", stream=False,
                         dataset="jsonl", dataset_path=str(prompts), output_len=[6], concurrency=[2],
                         num_requests=4, plots=False)
    level = run_benchmark(config)["levels"][0]
    assert level["completed"] == 4 and level["total_output_tokens"] == 24
    assert level["ttft_ms"]["count"] == 0  # no stream, no first token
    assert level["e2el_ms"]["median"] == pytest.approx(40 + 5 * 10, rel=0.5)


def write_sweep(tmp_path: Path, exit_after: int | None) -> Path:
    port = free_port()
    command = [sys.executable, mock_server.__file__, "--port", str(port), "--ttft-ms", "20", "--itl-ms", "5"]
    if exit_after is not None:
        command += ["--exit-after", str(exit_after)]
    sweep = {"out": str(tmp_path / "sweep"),
             "bench": {"concurrency": [1, 2], "num_requests": 4, "input_len": 8, "output_len": 4, "plots": False},
             "servers": [{"name": "mock", "command": command, "base_url": f"http://127.0.0.1:{port}",
                          "startup_timeout": 30}]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def test_sweep_exits_nonzero_when_its_server_dies(tmp_path, capsys):
    assert main(["bench", "sweep", str(write_sweep(tmp_path, exit_after=3))]) == 1
    import json

    status = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["servers"][0]
    assert status["status"] == "died" and status["exit_code"] == 3
    assert "mock: died" in capsys.readouterr().out
    requests = (tmp_path / "sweep" / "mock" / "requests.jsonl").read_text().splitlines()
    assert sum('"success": true' in line for line in requests) == 3  # the three before it died


def test_sweep_of_a_healthy_server_exits_zero(tmp_path):
    assert main(["bench", "sweep", str(write_sweep(tmp_path, exit_after=None))]) == 0
    assert (tmp_path / "sweep" / "mock" / "summary.json").is_file()


def test_sweep_commands_expand_home_and_variables(monkeypatch):
    from treeserve.bench.sweep import ServerSpec

    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("PEERS", "/opt/peers")
    spec = ServerSpec.from_dict({"base_url": "http://127.0.0.1:1", "command": "~/bin/serve $PEERS/model --port 1"}, 0)
    assert spec.command == ["/home/someone/bin/serve", "/opt/peers/model", "--port", "1"]


def test_ctrl_c_keeps_the_requests_that_finished(mock_url, tmp_path):
    """A user's Ctrl-C mid-level: exit 130, with the finished requests and their figures written
    (before, the run directory held config.json alone and every measurement was lost)."""
    import json
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    def served() -> float:
        text = urllib.request.urlopen(f"{mock_url}/metrics", timeout=5).read().decode()
        return float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("mock:request_success_total")))

    baseline, out = served(), tmp_path / "run"
    command = [sys.executable, "-m", "treeserve.cli", "bench", "serve", "--base-url", mock_url, "--out", str(out),
               "--concurrency", "2", "--num-requests", "60", "--input-len", "8", "--output-len", "20", "--no-plots"]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while served() < baseline + 4 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    level = summary["levels"][0]
    assert level["interrupted"] is True and 4 <= level["completed"] < 60 and level["failed"] == 0
    assert level["ttft_ms"]["count"] == level["completed"] and level["total_output_tokens"] == 20 * level["completed"]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == level["completed"] and all(row["end"] is not None and row["success"] for row in rows)
    assert (out / "telemetry.csv").is_file()


def test_ctrl_c_while_a_request_is_sent_cuts_the_requests_in_flight_short_never_failed(mock_url, tmp_path,
                                                                                      monkeypatch):
    """Ctrl-C's SystemExit (what lifecycle's handler raises, wherever the main thread is) raised while
    the load loop hands out the second request, the first being sent: the level was abandoned, the
    client pool closed under the first request while the loop still ran it, and the request was
    counted failed ("Can not write request body"; once in CI, the SIGINT test above). Now the level
    cancels its requests in flight first: both are cut short, none failed."""
    import json

    from treeserve.bench import run as bench_run
    from treeserve.bench.run import BenchConfig, RunLog, run_benchmark

    class Interrupting(list):
        def append(self, record):
            super().append(record)
            if len(self) == 2:
                raise SystemExit(130)
    monkeypatch.setattr(bench_run, "RunLog", lambda: RunLog(records=Interrupting()))
    out = tmp_path / "run"
    config = BenchConfig(base_url=mock_url, out=str(out), concurrency=[2], num_requests=6, input_len=[8],
                         output_len=[5], plots=False)
    with pytest.raises(SystemExit):
        run_benchmark(config)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["levels"] == [], summary
    assert (out / "requests.jsonl").read_text() == ""  # both cut short: left out, neither failed


def test_ctrl_c_surfaces_between_the_event_loops_callbacks_not_inside_the_code_it_lands_in(mock_url, tmp_path):
    """The SIGINT handler's SystemExit was raised wherever the main thread was: inside a protocol's
    callback, or inside asyncio's own bookkeeping (raised half-way through `call_soon`, it lost a
    callback, and the cleanup waited for it for ever: found by raising the exit at each line of a
    run in turn). The handler now runs as the event loop's callback: the code the signal lands in
    runs on to its next await, then the run stops as before (130, what finished written)."""
    import json
    import os
    import subprocess
    import textwrap

    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        import signal, sys
        from treeserve.bench import run
        from treeserve.lifecycle import exit_on_signals

        class Signalled(list):
            def append(self, record):
                super().append(record)
                if len(self) == 3:
                    signal.raise_signal(signal.SIGINT)
                    print("ran on after the signal", file=sys.stderr, flush=True)

        exit_on_signals(service=False)
        log = run.RunLog
        run.RunLog = lambda: log(records=Signalled())
        run.run_benchmark(run.BenchConfig(base_url={mock_url!r}, out={str(out)!r}, concurrency=[2], num_requests=6,
                                          input_len=[8], output_len=[5], plots=False))
    """)
    stopped = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                             stderr=subprocess.PIPE, text=True, timeout=60)
    assert stopped.returncode == 130, stopped.stderr
    assert "ran on after the signal\ntreeserve: SIGINT: stopping" in stopped.stderr, stopped.stderr
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True
    assert all(row["success"] for row in rows), rows


@pytest.mark.parametrize("plots", [False, True])
def test_the_closing_line_names_what_the_run_directory_holds(mock_url, tmp_path, capsys, plots):
    """(it named report.md and plots under --no-plots, which writes neither)"""
    out = tmp_path / "run"
    assert main(["bench", "serve", "--base-url", mock_url, "--out", str(out), "--concurrency", "2",
                 "--num-requests", "4", "--input-len", "8", "--output-len", "3",
                 *([] if plots else ["--no-plots"])]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run directory:"))
    assert ("report.md" in line) == plots and ("plots" in line) == plots, line
    assert all(name in line for name in ("summary.json", "requests.jsonl", "telemetry.csv")), line


def test_a_bench_started_before_its_server_waits_for_it(tmp_path, capsys):
    """`bench serve` right after `treeserve serve`, still loading: it waits for GET /v1/models, as
    `vllm bench serve --ready-check-timeout-sec` does (before, it failed at once: cannot reach)."""
    import threading

    from treeserve.bench.overhead import running_mock_server

    port, started, stop = free_port(), threading.Event(), threading.Event()

    def server_loads_then_serves():
        stop.wait(1.5)  # (the model loading)
        with running_mock_server(port, ttft_ms=5, itl_ms=1):
            started.set()
            stop.wait(60)

    server = threading.Thread(target=server_loads_then_serves)
    server.start()
    try:
        assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "run"),
                     "--num-requests", "2", "--input-len", "8", "--output-len", "2", "--no-plots",
                     "--ready-check-timeout-sec", "60"]) == 0
    finally:
        stop.set()
        server.join(timeout=30)
    assert started.is_set()
    err = capsys.readouterr().err
    assert f"waiting for http://127.0.0.1:{port} to be ready" in err and "is ready after" in err, err


@pytest.mark.parametrize("timeout", ["1", "0"])
def test_a_server_that_never_comes_up_is_a_clear_error_after_the_timeout(tmp_path, capsys, timeout):
    import time

    url = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    assert main(["bench", "serve", "--base-url", url, "--out", str(tmp_path / "run"),
                 "--ready-check-timeout-sec", timeout]) == 2
    assert time.monotonic() - began >= float(timeout)
    err = capsys.readouterr().err
    assert f"error: base_url: {url} was not ready" in err and "--ready-check-timeout-sec" in err, err
    assert ("waiting for" in err) == (timeout != "0"), err  # 0: one try, no waiting (and no progress lines)


def test_a_negative_ready_check_timeout_is_refused_before_any_request(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--out", str(tmp_path / "run"),
                 "--ready-check-timeout-sec", "-1"]) == 2
    err = capsys.readouterr().err
    assert "ready_check_timeout_sec: must be >= 0 seconds (0: no waiting), got -1" in err and "waiting" not in \
        err.replace("no waiting", ""), err

def test_a_wrong_api_key_fails_at_once_without_waiting(tmp_path):
    """401 will not change by waiting: the 600 s default must not be spent on it."""
    import asyncio
    import time

    from aiohttp import web

    from treeserve.bench.ready import served_models

    async def refuse(request):
        return web.json_response({"error": "bad key"}, status=401)

    async def scenario():
        app = web.Application()
        app.router.add_get("/v1/models", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            began = time.monotonic()
            with pytest.raises(ValueError, match="answered 401.*--api-key"):
                await served_models(f"http://127.0.0.1:{port}", "wrong", timeout_s=600)
            assert time.monotonic() - began < 5
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
