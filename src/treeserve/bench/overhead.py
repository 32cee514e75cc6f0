"""The client's own overhead, calibrated against the mock server, whose true TTFT and ITL are known
(the event-loop lag probe a run carries is in loop_lag.py)."""
from __future__ import annotations

import contextlib
import subprocess
import sys

from treeserve.bench import mock_server
from treeserve.bench.health import wait_healthy
from treeserve.bench.run import BenchConfig, run_benchmark


@contextlib.contextmanager
def running_mock_server(port: int, ttft_ms: float, itl_ms: float, exit_after: int | None = None):
    """The mock server in its own process (so it shares no event loop or GIL with the client)."""
    command = [sys.executable, mock_server.__file__, "--port", str(port), "--ttft-ms", str(ttft_ms),
               "--itl-ms", str(itl_ms)] + (["--exit-after", str(exit_after)] if exit_after is not None else [])
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def calibrate(out, port: int, ttft_ms: float = 100.0, itl_ms: float = 10.0, concurrency: int = 64,
              num_requests: int = 256, output_len: int = 32) -> dict:
    """Runs the benchmark against the mock server; returns true vs measured TTFT/ITL and the gap."""
    with running_mock_server(port, ttft_ms, itl_ms) as url:
        config = BenchConfig(base_url=url, out=str(out), concurrency=[concurrency], num_requests=num_requests,
                             input_len=[16], output_len=[output_len], warmup=concurrency, plots=False)
        summary = run_benchmark(config)
    level = summary["levels"][0]
    measured_ttft, measured_itl = level["ttft_ms"]["mean"], level["itl_ms"]["mean"]
    return {"concurrency": concurrency, "true_ttft_ms": ttft_ms, "measured_ttft_ms": measured_ttft,
            "ttft_overhead_ms": measured_ttft - ttft_ms, "true_itl_ms": itl_ms, "measured_itl_ms": measured_itl,
            "itl_overhead_ms": measured_itl - itl_ms, "ttft_p99_ms": level["ttft_ms"]["p99"],
            "itl_p99_ms": level["itl_ms"]["p99"], **level["client"]}
