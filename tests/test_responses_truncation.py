"""`truncation: "auto"` over any chat function (wire/responses_truncation.py): the oldest turns go
whole until the chat takes the conversation, system messages stay, the last turn stays."""
from __future__ import annotations

import asyncio

import pytest

from treeserve.wire.errors import APIError
from treeserve.wire.responses_truncation import PromptCount, fitted, without_oldest_turn

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


def _sized_chat(max_model_len: int, completion: int, sent: list, knows_context: bool = False):
    """A chat whose prompt is one token a character of its messages' contents, refused as treeserve's
    server refuses a prompt past its context (OpenAI's sentence), and the count of such a prompt (with
    the context's size where it `knows_context`)."""
    async def count(body: dict) -> PromptCount:
        return PromptCount(sum(len(m["content"] or "") for m in body["messages"]),
                           max_model_len if knows_context else None)

    async def chat(body: dict) -> dict:
        sent.append(body["messages"])
        prompt = (await count(body)).tokens
        if prompt + completion > max_model_len:
            raise APIError(400, f"input: This model's maximum context length is {max_model_len} tokens. However, "
                                f"you requested {prompt + completion} tokens ({prompt} in the messages, {completion} "
                                "in the completion). Please reduce the length of the messages or completion.",
                           param="input", code="context_length_exceeded")
        return {"ok": True}
    return chat, count


def test_auto_counts_the_turns_to_drop_and_sends_the_chat_twice_however_many_go():
    """Each chat sent is a request on the gateway's key (its rpm_limit, a spend_logs row): "auto" sent
    one per turn dropped, so a key with rpm_limit 3 got a 429 for one response whose conversation had
    to lose three turns. The refusal states the context; counting (unbilled) finds the turns to drop."""
    turns = [[{"role": "user", "content": "u" * 10}, {"role": "assistant", "content": "a" * 10}] for _ in range(20)]
    conversation = [SYSTEM] + [m for turn in turns for m in turn] + [{"role": "user", "content": "q" * 10}]
    counted, sent = [], []
    chat, count = _sized_chat(105, 4, sent)

    async def counting(body: dict) -> PromptCount:
        counted.append(body)
        return await count(body)
    body, result = asyncio.run(fitted({"messages": conversation}, chat, "auto", counting))
    # (the system message, the last 4 turns and the question: 1 + 4 * 20 + 10 = 91 tokens fit beside 4; 5 turns do not)
    assert result == {"ok": True} and body["messages"] == [SYSTEM] + conversation[-9:] and len(sent) == 2
    # (the whole conversation counted first: this count does not know the context, so the chat says it;
    # then a binary search over the 20 turns)
    assert counted[0]["messages"] == conversation and len(counted[1:]) <= 5
    one_at_a_time: list = []
    assert asyncio.run(fitted({"messages": conversation}, _sized_chat(105, 4, one_at_a_time)[0], "auto"))[0] == body
    assert len(one_at_a_time) == 17  # (without a count: the old way, still right where nothing can be counted)


def test_auto_with_a_count_still_refuses_a_last_turn_too_long():
    sent: list = []
    chat, count = _sized_chat(20, 4, sent)
    conversation = [SYSTEM, {"role": "user", "content": "u" * 10}, {"role": "user", "content": "q" * 30}]
    with pytest.raises(APIError) as caught:
        asyncio.run(fitted({"messages": conversation}, chat, "auto", count))
    assert caught.value.code == "context_length_exceeded" and sent[-1] == [SYSTEM, conversation[2]] and len(sent) == 2


def test_auto_counts_before_the_first_chat_where_the_count_knows_the_context():
    """The count knows the context's size (the server's own, a backend's /tokenize `max_model_len`): the
    turns that cannot fit go before any chat is sent, so the chat is sent once (before: sent as it
    was, refused, and its refusal's wording read for the context's size, then sent again)."""
    turns = [[{"role": "user", "content": "u" * 10}, {"role": "assistant", "content": "a" * 10}] for _ in range(20)]
    conversation = [SYSTEM] + [m for turn in turns for m in turn] + [{"role": "user", "content": "q" * 10}]
    sent: list = []
    chat, count = _sized_chat(105, 4, sent, knows_context=True)
    body, result = asyncio.run(fitted({"messages": conversation, "max_tokens": 4}, chat, "auto", count))
    assert result == {"ok": True} and body["messages"] == [SYSTEM] + conversation[-9:] and len(sent) == 1
    # no max_tokens: the room is the context less one token (one is always generated)
    sent.clear()
    chat, count = _sized_chat(92, 1, sent, knows_context=True)
    body, _ = asyncio.run(fitted({"messages": conversation}, chat, "auto", count))
    assert body["messages"] == [SYSTEM] + conversation[-9:] and len(sent) == 1
    # what fits is sent as it is; "disabled" never counts
    sent.clear()
    asyncio.run(fitted({"messages": conversation[:3]}, chat, "auto", count))
    assert sent == [conversation[:3]]

    async def never(body):
        raise AssertionError("counted with truncation disabled")
    with pytest.raises(APIError):
        asyncio.run(fitted({"messages": conversation}, _sized_chat(92, 1, [])[0], "disabled", never))


def test_a_count_that_fails_falls_back_to_the_refusal():
    turns = [[{"role": "user", "content": "u" * 10}, {"role": "assistant", "content": "a" * 10}] for _ in range(5)]
    conversation = [SYSTEM] + [m for turn in turns for m in turn] + [{"role": "user", "content": "q" * 10}]
    sent: list = []
    chat, _ = _sized_chat(50, 4, sent)

    async def fails(body: dict) -> PromptCount:
        raise APIError(502, "no backend can count", code="backend_error")
    body, result = asyncio.run(fitted({"messages": conversation, "max_tokens": 4}, chat, "auto", fails))
    # (room 46: the system message, one turn and the question: 1 + 20 + 10 fit; two turns do not)
    assert result == {"ok": True} and body["messages"] == [SYSTEM] + conversation[-3:] and len(sent) == 5  # (a turn a chat)
