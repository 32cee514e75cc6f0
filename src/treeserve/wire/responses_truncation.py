"""`truncation: "auto"` (OpenAI's): a conversation longer than the model's context loses its oldest
items until it fits. The system and developer messages (`instructions` among them) stay; the others go
a turn at a time, whole (a user's message and what follows it up to the next one: answers, tool calls
and their results), so that what is left starts with a user's message, as chat templates expect. The
last turn always stays: a request whose last turn alone cannot fit is still the context-length 400.
How many messages went is logged (`treeserve.responses`). With "disabled" (the default) a
conversation too long is the 400."""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.responses")
KEPT_ROLES = ("system", "developer")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def without_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """The messages less those (not system or developer) before the second user message from the start,
    or None when there is no second one (one turn is left)."""
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    if len(users) < 2:
        return None
    return [message for i, message in enumerate(messages) if i >= users[1] or message["role"] in KEPT_ROLES]


async def fitted(body: dict, send: Callable[[dict], Awaitable], truncation: str | None) -> tuple[dict, object]:
    """(the chat body sent, its result): with truncation "auto", the oldest turns dropped one at a
    time while the chat is refused for its context length."""
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
            dropped += len(body["messages"]) - len(fewer)
            body = body | {"messages": fewer}
            continue
        if dropped:
            log.info("truncation=auto: dropped the %d oldest messages of the conversation to fit the context "
                     "(%d left)", dropped, len(body["messages"]))
        return body, result
