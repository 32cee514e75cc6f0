"""The part of a conversation that fits its model's context, as chat UIs do: the system prompt and the
newest message are always sent, the oldest turns are left out until prompt + max_tokens fits the
model's `max_model_len`. The prompt is measured by the backend's own `/tokenize` (the chat template
rendered as the request will be), which also names the model's context length.

A kept part begins at a user message, never inside a turn: an assistant's tool calls stay with their
tool results and the answer that follows. A backend that never answers `/tokenize` (another server's
API) gets the whole history. A measure that fails once the first has answered (a backend restarting,
a 5xx, a timeout) counts as "does not fit": what is sent is a part a measure said fits, never one
guessed; where none was, the user is told to try again."""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import Response

from treeserve.gateway.chat.upstream import UpstreamError

Measure = Callable[[list[dict]], Awaitable[Response]]
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # (OpenAI's error code for a prompt too long)


@dataclass
class Window:
    messages: list[dict]
    left_out: int = 0  # earlier messages not sent


@dataclass
class Size:
    count: int       # prompt tokens
    limit: int       # the model's context length

    def fits(self, max_tokens: int) -> bool:
        return self.count + max_tokens <= self.limit


async def fit(messages: list[dict], max_tokens: int, model: str, measure: Measure) -> Window:
    """`messages`: the system prompt (if any), the history, the new message, in order."""
    head = 1 if messages[0]["role"] == "system" else 0
    starts = [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]  # where a kept part may begin
    whole = await _size(messages, measure)
    if whole is None or whole.fits(max_tokens):  # (None: the backend cannot measure)
        return Window(messages)
    measured: dict[int, Size | None] = {}

    async def size_from(start: int) -> Size | None:
        if measured.get(start) is None:  # (a failed measure is tried again only for the newest message alone)
            measured[start] = await _size(messages[:head] + messages[start:], measure)
        return measured[start]

    # the fewest turns left out that fit (counts shrink as more are left out); starts[0] is the whole but
    # a leading assistant message
    low, high = (1 if starts[0] == head else 0), len(starts) - 1
    while low <= high:
        middle = (low + high) // 2
        size = await size_from(starts[middle])
        if size is not None and size.fits(max_tokens):
            high = middle - 1
        else:  # too long, or not measured: only a part measured to fit is sent
            low = middle + 1
    if low == len(starts):  # not even the newest message alone, as far as was measured
        low -= 1
        size = await size_from(starts[low])
        if size is None:
            raise UpstreamError(f"{model}'s backend could not measure this conversation against its context of "
                                f"{whole.limit} tokens just now; try again in a moment")
        if not size.fits(max_tokens):
            raise UpstreamError(_too_long(size, max_tokens, model), code=CONTEXT_LENGTH_EXCEEDED)
    return Window(messages[:head] + messages[starts[low]:], starts[low] - head)


async def _size(messages: list[dict], measure: Measure) -> Size | None:
    """The prompt's size, or None where the backend did not tell (no `/tokenize`, an error, a timeout)."""
    try:
        response = await measure(messages)
        reply = json.loads(response.body) if response.status_code == 200 else {}
        return Size(int(reply["count"]), int(reply["max_model_len"]))
    except (UpstreamError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _too_long(size: Size, max_tokens: int, model: str) -> str:
    return (f"this message does not fit {model}'s context of {size.limit} tokens: it takes {size.count} tokens "
            f"(with the system prompt) and the answer may take {max_tokens} (Max tokens in Settings); shorten it "
            "or lower Max tokens")
