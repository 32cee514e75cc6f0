"""The chat's context window (gateway/chat/window.py): the oldest turns are left out until prompt +
max_tokens fits the model's context, the system prompt and the newest message always kept; a message
that cannot fit alone is a clear error; a backend that cannot measure gets the whole history."""
from __future__ import annotations

import anyio
import pytest
from fastapi.responses import JSONResponse

from treeserve.gateway.chat.upstream import UpstreamError
from treeserve.gateway.chat.window import fit


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "terse"}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return messages + [{"role": "user", "content": "newest"}]


async def hundred_each(kept: list[dict]):  # each message 100 tokens, a 512-token model
    return JSONResponse({"count": 100 * len(kept), "max_model_len": 512})


def test_the_oldest_turns_are_left_out_until_it_fits():
    window = anyio.run(fit, conversation(4), 100, "arith-gen", hundred_each)
    assert [m["content"] for m in window.messages] == ["terse", "q3", "a3", "newest"] and window.left_out == 6
    whole = anyio.run(fit, conversation(1), 100, "arith-gen", hundred_each)
    assert whole.left_out == 0 and len(whole.messages) == 4


def test_a_message_that_cannot_fit_alone_says_so():
    with pytest.raises(UpstreamError, match=r"does not fit arith-gen's context of 512 tokens: it takes 200 tokens.*"
                                            r"answer may take 400 \(Max tokens"):
        anyio.run(fit, conversation(3), 400, "arith-gen", hundred_each)


def test_a_backend_without_tokenize_gets_everything():
    async def missing(kept):
        return JSONResponse({"error": {"message": "not found"}}, status_code=404)
    assert anyio.run(fit, conversation(9), 100, "echo", missing).messages == conversation(9)


def measures_failing(failures: set[int], how: str = "503"):
    """`hundred_each`, except that the calls numbered in `failures` (0: the first) fail `how`: a 5xx (a
    backend restarting), a refusal raised by the gateway, or a 200 that is not /tokenize's answer."""
    calls = []

    async def measure(kept):
        calls.append(len(kept))
        if len(calls) - 1 not in failures:
            return await hundred_each(kept)
        if how == "raised":
            raise UpstreamError("the model is not available right now")
        if how == "garbled":
            return JSONResponse({"count": None})
        return JSONResponse({"error": {"message": "no backend could answer"}}, status_code=503)
    measure.calls = calls
    return measure


@pytest.mark.parametrize("how", ["503", "raised", "garbled"])
def test_a_measure_that_fails_part_way_sends_only_a_part_measured_to_fit(how):
    # 100 tokens a message, 512 in all, 100 for the answer: 4 messages fit. The first cut tried (6
    # messages, too long) is not measured: it must not be taken for "fits" and sent
    measure = measures_failing({1}, how)
    window = anyio.run(fit, conversation(4), 100, "arith-gen", measure)
    assert [m["content"] for m in window.messages] == ["terse", "q3", "a3", "newest"] and window.left_out == 6
    assert 100 * len(window.messages) + 100 <= 512


@pytest.mark.parametrize("how", ["503", "raised"])
def test_a_backend_that_stops_measuring_part_way_is_an_error_naming_its_context(how):
    # the first measure said the whole is too long; every later one failed: nothing is known to fit
    with pytest.raises(UpstreamError, match=r"could not measure this conversation against its context of 512 tokens"
                                            r".*try again") as raised:
        anyio.run(fit, conversation(4), 100, "arith-gen", measures_failing(set(range(1, 99)), how))
    assert "None" not in str(raised.value) and raised.value.code is None


def test_a_message_measured_too_long_is_told_so_when_a_later_measure_fails():
    # the newest message alone was measured too long during the search: no more measures are needed to say
    # so, and a failing one cannot turn the error into "context of None"
    measure = measures_failing(set(range(3, 99)))
    with pytest.raises(UpstreamError, match=r"context of 512 tokens: it takes 200 tokens") as raised:
        anyio.run(fit, conversation(3), 400, "arith-gen", measure)
    assert raised.value.code == "context_length_exceeded" and "None" not in str(raised.value)


def test_the_newest_message_alone_is_measured_again_after_a_failure():
    # (a transient failure on the last cut tried: measured again, it fits, and is sent)
    window = anyio.run(fit, conversation(3), 300, "arith-gen", measures_failing({2}))
    assert [m["content"] for m in window.messages] == ["terse", "newest"] and window.left_out == 6


def test_a_window_never_starts_inside_a_tool_exchange():
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "sympy", "arguments": "{}"}}]}
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "q0"}, call,
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}, {"role": "assistant", "content": "a0"},
                {"role": "user", "content": "q1"}, call, {"role": "tool", "tool_call_id": "call_1", "content": "9"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "newest"}]
    for max_tokens in range(1, 313, 13):  # every budget the newest message fits: a user message begins the kept part
        window = anyio.run(fit, messages, max_tokens, "arith-gen", hundred_each)
        kept = window.messages[1:]
        assert kept[0]["role"] == "user" and len(kept) + window.left_out == len(messages) - 1, max_tokens
        for i, message in enumerate(kept):
            if message["role"] == "tool":
                assert kept[i - 1].get("tool_calls") or kept[i - 1]["role"] == "tool"


def test_a_leading_assistant_message_alone_can_be_left_out():
    messages = [{"role": "system", "content": "terse"}, {"role": "assistant", "content": "Hello! Ask me anything."},
                {"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"},
                {"role": "user", "content": "newest"}]
    window = anyio.run(fit, messages, 100, "arith-gen", hundred_each)  # 4 of the 5 fit
    assert [m["content"] for m in window.messages] == ["terse", "q0", "a0", "newest"] and window.left_out == 1
