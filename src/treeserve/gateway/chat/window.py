"""The part of a conversation that fits its model's context, as chat UIs do: the system prompt and the
newest message are always sent, the oldest turns are left out until prompt + max_tokens fits the
model's `max_model_len`. The prompt is measured by the backend's own `/tokenize` (the chat template
rendered as the request will be), which also names the model's context length; a backend without
`/tokenize` (another server's API) gets the whole history."""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import Response

from treeserve.gateway.chat.upstream import UpstreamError

Measure = Callable[[list[dict]], Awaitable[Response]]


@dataclass
class Window:
    messages: list[dict]
    left_out: int = 0  # earlier messages not sent


async def fit(messages: list[dict], max_tokens: int, model: str, measure: Measure) -> Window:
    """`messages`: the system prompt (if any), the history, the new message, in order."""
    head = 1 if messages[0]["role"] == "system" else 0
    starts = [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]  # where a kept part may begin
    count, limit = await _size(messages, measure)
    if limit is None or count + max_tokens <= limit:
        return Window(messages)
    low, high = 1, len(starts) - 1  # the fewest turns left out that fit: counts shrink as more are left out
    while low <= high:
        middle = (low + high) // 2
        kept = messages[:head] + messages[starts[middle]:]
        count, limit = await _size(kept, measure)
        if limit is None or count + max_tokens <= limit:
            high = middle - 1
        else:
            low = middle + 1
    if low == len(starts):
        newest = messages[:head] + messages[starts[-1]:]
        raise UpstreamError(_too_long(*(await _size(newest, measure)), max_tokens, model))
    return Window(messages[:head] + messages[starts[low]:], starts[low] - head)


async def _size(messages: list[dict], measure: Measure) -> tuple[int, int | None]:
    """(prompt tokens, the model's context length), or (0, None) where the backend cannot tell."""
    response = await measure(messages)
    try:
        reply = json.loads(response.body) if response.status_code == 200 else {}
        return int(reply["count"]), int(reply["max_model_len"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0, None


def _too_long(count: int, limit: int | None, max_tokens: int, model: str) -> str:
    return (f"this message does not fit {model}'s context of {limit} tokens: it takes {count} tokens (with the "
            f"system prompt) and the answer may take {max_tokens} (Max tokens in Settings); shorten it or lower "
            "Max tokens")
