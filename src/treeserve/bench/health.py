"""Waiting for a server to come up: what every benchmark, and `treeserve chat`, does after starting one."""
from __future__ import annotations

import contextlib
import subprocess
import time

import httpx


def wait_healthy(base_url: str, process: subprocess.Popen | None, timeout: float) -> None:
    """Polls GET /health until 200; raises if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url.rstrip('/')}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout:.0f} s")
