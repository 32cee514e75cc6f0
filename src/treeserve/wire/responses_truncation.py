"""`truncation: "auto"` (OpenAI's): a conversation longer than the model's context loses its oldest
items until it fits. The system and developer messages (`instructions` among them) stay; the others go
a turn at a time, whole (a user's message and what follows it up to the next one: answers, tool calls
and their results), so that what is left starts with a user's message, as chat templates expect. The
last turn always stays: a request whose last turn alone cannot fit is still the context-length 400.
How many messages went is logged (`treeserve.responses`). With "disabled" (the default) a
conversation too long is the 400.

The prompt is counted before any chat is sent (`count`: the chat template's tokens, neither admitted
nor billed; it says the context's size too: the server's own, a backend's /tokenize `max_model_len`),
and the fewest oldest turns that leave room for the completion (`max_tokens`, at least one token) go,
so the chat is sent once: on the gateway each chat is a request on the key's rate limits. Where the
count does not know the context's size, or fails, the chat is sent as it is; its refusal says the
context's size and the completion's tokens (OpenAI's sentence, which treeserve's servers write), and the
turns to drop are counted then (the chat is sent twice); where the refusal does not say them (another
server's wording), turns go one refused chat at a time."""
from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from treeserve.errors import ContextLengthError
from treeserve.wire.errors import APIError, from_value_error

log = logging.getLogger("treeserve.responses")
KEPT_ROLES = ("system", "developer")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_MODEL_LEN = re.compile(r"maximum context length is (\d+) tokens")
COMPLETION_TOKENS = re.compile(r"(\d+) in the completion")


@dataclass(frozen=True)
class PromptCount:
    """A chat's prompt tokens, and the context's size where the counter knows it."""
    tokens: int
    max_model_len: int | None = None


CountFn = Callable[[dict], Awaitable[PromptCount]]  # a chat completions body in; its prompt counted (unbilled)


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
                 count: CountFn | None = None) -> tuple[dict, object]:
    """(the chat body sent, its result): with truncation "auto", the oldest turns dropped that counting
    shows must go, before the chat is sent, and then while the chat is refused for its context length."""
    fitting = await counted_fit(body, count) if truncation == "auto" and count is not None else body
    dropped = len(body["messages"]) - len(fitting["messages"])
    body = fitting
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


async def counted_fit(body: dict, count: CountFn) -> dict:
    """`body` less the fewest oldest turns that leave its prompt room for its completion in the
    context, as counted (the last turn alone if none fits); `body` as it is where it fits, where the
    count does not know the context's size, or where counting fails."""
    try:
        counted = await count(body)
    except APIError:
        return body
    if counted.max_model_len is None:
        return body
    room = counted.max_model_len - completion_tokens(body)
    fewer = without_oldest_turn(body["messages"]) if counted.tokens > room else None
    if fewer is None:
        return body
    return body | {"messages": await _fewest_dropped(body, fewer, count, room)}


def completion_tokens(body: dict) -> int:
    """The tokens a chat asks the context to hold beside its prompt: its max_tokens, at least one (as a
    server checks a prompt: one token is always generated)."""
    return max(body.get("max_completion_tokens") or body.get("max_tokens") or 0, 1)


def check_fits(body: dict, counted: PromptCount) -> None:
    """The context-length 400 a chat of `body` gets (its prompt counted) where it cannot fit."""
    if counted.max_model_len is not None and counted.tokens + completion_tokens(body) > counted.max_model_len:
        raise from_value_error(ContextLengthError("messages", counted.max_model_len, counted.tokens,
                                                  completion_tokens(body)))


def _prompt_room(refusal: APIError) -> int | None:
    """The prompt tokens the context holds beside the completion, as the refusal states them (None: it does not)."""
    size, completion = MAX_MODEL_LEN.search(refusal.message), COMPLETION_TOKENS.search(refusal.message)
    return int(size.group(1)) - int(completion.group(1)) if size and completion else None


async def _fewest_dropped(body: dict, messages: list[dict], count: CountFn, room: int) -> list[dict]:
    """`messages` less their fewest oldest turns that leave a prompt of at most `room` tokens (a binary
    search over the turns: the prompt shrinks as turns go); the last turn alone if none fits, `messages`
    as they are if counting fails."""
    users = _user_messages(messages)
    low, high = 0, len(users) - 1
    try:
        while low < high:
            middle = (low + high) // 2
            if (await count(body | {"messages": _from_turn(messages, users, middle)})).tokens <= room:
                high = middle
            else:
                low = middle + 1
    except APIError:
        return messages
    return _from_turn(messages, users, low)
