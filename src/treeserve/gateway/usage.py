"""Tokens a request used, as its backend reported them (or as the gateway counted them)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger("treeserve.gateway")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def read_usage(value: object) -> tuple[Usage, bool]:
    """A backend's `usage` object read defensively: (its tokens, whether it was well formed). A
    count that is not a whole number >= 0 counts 0, and so does a usage that is not an object: a
    backend's bad bookkeeping never fails its client's answer."""
    if value is None:
        return Usage(), True
    if not isinstance(value, dict):
        return Usage(), False
    (prompt, prompt_ok), (completion, completion_ok) = map(_count, (value.get("prompt_tokens"),
                                                                    value.get("completion_tokens")))
    return Usage(prompt, completion), prompt_ok and completion_ok


def answer_usage(content: bytes, backend: str) -> Usage | None:
    """A whole answer's usage; None when the answer is not a JSON object (no answer at all)."""
    try:
        answer = json.loads(content)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    usage, clean = read_usage(answer.get("usage"))
    if not clean:
        malformed_usage(backend, answer.get("usage"))
    return usage


def malformed_usage(backend: str, value: object) -> None:
    log.warning("backend %s reported a malformed usage (%.200r): its bad counts are taken as 0", backend, value)


def token_details(answer: object) -> tuple[int, int]:
    """An answer's cached prompt tokens and reasoning tokens (`usage.prompt_tokens_details.cached_tokens`,
    `usage.completion_tokens_details.reasoning_tokens`), 0 where it does not report them well formed."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    usage = usage if isinstance(usage, dict) else {}

    def detail(part: str, name: str) -> int:
        details = usage.get(part)
        return _count(details.get(name))[0] if isinstance(details, dict) else 0
    return detail("prompt_tokens_details", "cached_tokens"), detail("completion_tokens_details", "reasoning_tokens")


def _count(value: object) -> tuple[int, bool]:
    if value is None:
        return 0, True
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, True
    return 0, False
