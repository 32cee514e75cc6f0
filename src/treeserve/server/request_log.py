"""vLLM's per-request log lines, off unless `--enable-log-requests`: `Received request ID: prompt: ...,
params: ..., prompt_token_ids: ...` when a chat or completion prompt goes to the engine, then
`Finished request ID.` or `Aborted request ID.` (its client left, or it failed). The logger's level is
the switch: WARNING here, INFO with the flag (server/launch.py)."""
from __future__ import annotations

import logging

from treeserve.sampling_params import SamplingParams

log = logging.getLogger("treeserve.requests")
log.setLevel(logging.WARNING)


def enable(on: bool) -> None:
    log.setLevel(logging.INFO if on else logging.WARNING)


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def received(request_id: str, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int]) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, prompt, params,
                 prompt_token_ids)


def ended(request_id: str, finished: bool) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("%s request %s.", "Finished" if finished else "Aborted", request_id)
