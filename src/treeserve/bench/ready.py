"""Waiting for the server a run loads, as `vllm bench serve --ready-check-timeout-sec` does: a run
started right after `treeserve serve` (still loading its model) waits for it instead of failing.

The server is ready when GET /v1/models answers 200 with a model: what the run reads first, and
what every OpenAI-compatible server has (a treeserve server binds its port once the model is loaded;
a gateway lists a model once a backend of it passes its health check)."""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from treeserve.errors import ParamError

DEFAULT_READY_TIMEOUT_S = 600  # vLLM's --ready-check-timeout-sec
RETRY_S = 0.5
PROGRESS_EVERY_S = 5.0
PROBE_TIMEOUT_S = 30.0
FINAL_STATUSES = (401, 403)  # a wrong key or no access: waiting would not change the answer


class NotReady(Exception):
    """The server has not answered as a ready one yet (the reason is the message)."""


async def served_models(base_url: str, api_key: str | None, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> list[str]:
    """The ids GET /v1/models lists, polled until it answers 200 with at least one model, for up to
    `timeout_s` seconds (0: one try, no waiting); progress goes to stderr every few seconds.
    ParamError naming base_url after the timeout, or at once for an answer that waiting cannot change.
    (A negative timeout is refused by BenchConfig.)"""
    began = time.monotonic()
    next_report = began
    while True:
        try:
            models = await _models(base_url, api_key)
        except NotReady as exc:
            waited = time.monotonic() - began
            if waited >= timeout_s:
                raise ParamError("base_url", _timeout_message(base_url, timeout_s, exc)) from None
            if time.monotonic() >= next_report:
                _report(base_url, waited, timeout_s, exc)
                next_report += PROGRESS_EVERY_S
            await asyncio.sleep(min(RETRY_S, max(0.0, timeout_s - waited)))
            continue
        if next_report > began:  # (it had to wait)
            print(f"[bench] {base_url} is ready after {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
        return models


async def _models(base_url: str, api_key: str | None) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as session, \
                session.get(f"{base_url.rstrip('/')}/v1/models", headers=headers) as response:
            status, text = response.status, await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise NotReady(f"cannot reach it: {type(exc).__name__}: {exc}") from None
    if status in FINAL_STATUSES:
        raise ParamError("base_url", f"GET /v1/models answered {status}: {text[:200]} (check --api-key)")
    if status != 200:
        raise NotReady(f"GET /v1/models answered {status}: {text[:200]}")
    try:
        models = [model["id"] for model in json.loads(text).get("data") or []]
    except (ValueError, AttributeError, KeyError, TypeError):
        raise NotReady(f"GET /v1/models answered 200 with no model list: {text[:200]}") from None
    if not models:
        raise NotReady("GET /v1/models lists no model yet")
    return models


def _report(base_url: str, waited: float, timeout_s: float, reason: NotReady) -> None:
    print(f"[bench] waiting for {base_url} to be ready: {waited:.0f} s of {timeout_s:g} s "
          f"(--ready-check-timeout-sec); {reason}", file=sys.stderr, flush=True)


def _timeout_message(base_url: str, timeout_s: float, reason: NotReady) -> str:
    waited = f"within {timeout_s:g} s" if timeout_s else "(--ready-check-timeout-sec 0: no waiting)"
    return (f"{base_url} was not ready {waited}: {reason}. Start the server there, or wait longer with "
            f"--ready-check-timeout-sec")
