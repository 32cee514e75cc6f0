"""Waiting for a server to come up: what every benchmark, and `treeserve chat`, does after starting one."""
from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Collection

import httpx


def wait_healthy(base_url: str, process: subprocess.Popen | None, timeout: float,
                 models: Collection[str] = ()) -> None:
    """Polls GET /health until 200 (and, given `models`, until GET /v1/models lists each of them: the
    server that answers is the one started, not another on the same port); raises if the process
    exits first or time runs out."""
    base_url = base_url.rstrip("/")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200 and _serves(base_url, models):
                return
        time.sleep(0.1)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout:.0f} s"
                       + (f" with {', '.join(models)} in /v1/models" if models else ""))


def _serves(base_url: str, models: Collection[str]) -> bool:
    if not models:
        return True
    response = httpx.get(f"{base_url}/v1/models", timeout=2)
    return response.status_code == 200 and set(models) <= {m["id"] for m in response.json().get("data", [])}
