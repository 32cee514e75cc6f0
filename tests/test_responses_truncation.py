"""`truncation: "auto"` over any chat function (wire/responses_truncation.py): the oldest turns go
whole until the chat takes the conversation, system messages stay, the last turn stays."""
from __future__ import annotations

import asyncio

import pytest

from treeserve.wire.errors import APIError
from treeserve.wire.responses_truncation import fitted, without_oldest_turn

SYSTEM = {"role": "system", "content": "s"}
CONVERSATION = [SYSTEM, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"}, {"role": "assistant", "content": "a1"},
                {"role": "developer", "content": "d"}, {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]


def _chat_of(limit: int, sent: list):
    """A chat that takes at most `limit` messages (else the context-length 400)."""
    async def chat(body: dict) -> dict:
        sent.append(body["messages"])
        if len(body["messages"]) > limit:
            raise APIError(400, "input: too long", param="input", code="context_length_exceeded")
        return {"ok": True}
    return chat


def test_a_turn_goes_whole_and_system_messages_stay():
    assert without_oldest_turn(CONVERSATION) == [SYSTEM, {"role": "developer", "content": "d"}] + CONVERSATION[6:]
    assert without_oldest_turn([SYSTEM, {"role": "user", "content": "u"}]) is None


def test_auto_drops_turns_until_it_fits_and_disabled_does_not():
    sent: list = []
    body, result = asyncio.run(fitted({"messages": CONVERSATION}, _chat_of(4, sent), "auto"))
    assert result == {"ok": True} and body["messages"] == [SYSTEM, CONVERSATION[5], CONVERSATION[8]]
    assert len(sent) == 3
    for truncation in ("disabled", None):
        with pytest.raises(APIError):
            asyncio.run(fitted({"messages": CONVERSATION}, _chat_of(4, []), truncation))


def test_the_last_turn_too_long_is_still_the_400_and_other_errors_are_not_retried():
    sent: list = []
    with pytest.raises(APIError) as caught:
        asyncio.run(fitted({"messages": CONVERSATION}, _chat_of(1, sent), "auto"))
    assert caught.value.code == "context_length_exceeded" and sent[-1] == [SYSTEM, CONVERSATION[5], CONVERSATION[8]]

    async def refuses(body):
        sent.append(body)
        raise APIError(400, "temperature: bad", param="temperature")
    sent.clear()
    with pytest.raises(APIError):
        asyncio.run(fitted({"messages": CONVERSATION}, refuses, "auto"))
    assert len(sent) == 1
