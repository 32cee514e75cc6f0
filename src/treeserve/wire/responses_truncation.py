"""`truncation: "auto"` (OpenAI's): a conversation longer than the model's context loses its oldest
items until it fits. The system and developer messages (`instructions` among them) stay; the others go
a turn at a time, whole (a user's message and what follows it up to the next one: answers, tool calls
and their results), so that what is left starts with a user's message, as chat templates expect. The
last turn always stays: a request whose last turn alone cannot fit is still the context-length 400.
How many messages went is logged (`treeserve.responses`). With "disabled" (the default) a
conversation too long is the 400.

The chat is sent once as it is; its refusal says the context's size and the completion's tokens
(OpenAI's sentence, which treeserve's servers write), and the turns to drop are then found by
counting the prompt's tokens (`count`: neither admitted nor billed), so the chat is sent a second
time only, however many turns go: on the gateway each chat is a request on the key's rate limits.
Where the refusal does not say them (another server's wording) or counting fails, turns go one
refused chat at a time."""
from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.responses")
KEPT_ROLES = ("system", "developer")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_MODEL_LEN = re.compile(r"maximum context length is (\d+) tokens")
COMPLETION_TOKENS = re.compile(r"(\d+) in the completion")


def without_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """The messages less those (not system or developer) before the second user message from the start,
    or None when there is no second one (one turn is left)."""
    users = _user_messages(messages)
    return _from_turn(messages, users, 1) if len(users) >= 2 else None


def _user_messages(messages: list[dict]) -> list[int]:
    return [i for i, message in enumerate(messages) if message["role"] == "user"]


def _from_turn(messages: list[dict], users: list[int], turn: int) -> list[dict]:
    """The messages from the `turn`th user message on, and the system and developer ones before it."""
    return [message for i, message in enumerate(messages) if i >= users[turn] or message["role"] in KEPT_ROLES]


async def fitted(body: dict, send: Callable[[dict], Awaitable], truncation: str | None,
                 count: Callable[[dict], Awaitable[int]] | None = None) -> tuple[dict, object]:
    """(the chat body sent, its result): with truncation "auto", the oldest turns dropped while the
    chat is refused for its context length (as many as counting shows must go, where it can)."""
    dropped = 0
    while True:
        try:
            result = await send(body)
        except APIError as exc:
            fewer = without_oldest_turn(body["messages"]) if truncation == "auto" and \
                exc.code == CONTEXT_LENGTH_EXCEEDED else None
            if fewer is None:
                if dropped:
                    log.info("truncation=auto: dropped %d messages and the last turn still does not fit", dropped)
                raise
            room = _prompt_room(exc)
            if count is not None and room is not None:
                fewer = await _fewest_dropped(body, fewer, count, room)
            dropped += len(body["messages"]) - len(fewer)
            body = body | {"messages": fewer}
            continue
        if dropped:
            log.info("truncation=auto: dropped the %d oldest messages of the conversation to fit the context "
                     "(%d left)", dropped, len(body["messages"]))
        return body, result


def _prompt_room(refusal: APIError) -> int | None:
    """The prompt tokens the context holds beside the completion, as the refusal states them (None: it does not)."""
    size, completion = MAX_MODEL_LEN.search(refusal.message), COMPLETION_TOKENS.search(refusal.message)
    return int(size.group(1)) - int(completion.group(1)) if size and completion else None


async def _fewest_dropped(body: dict, messages: list[dict], count: Callable[[dict], Awaitable[int]], room: int) -> list[dict]:
    """`messages` less their fewest oldest turns that leave a prompt of at most `room` tokens (a binary
    search over the turns: the prompt shrinks as turns go); the last turn alone if none fits, `messages`
    as they are if counting fails."""
    users = _user_messages(messages)
    low, high = 0, len(users) - 1
    try:
        while low < high:
            middle = (low + high) // 2
            if await count(body | {"messages": _from_turn(messages, users, middle)}) <= room:
                high = middle
            else:
                low = middle + 1
    except APIError:
        return messages
    return _from_turn(messages, users, low)
