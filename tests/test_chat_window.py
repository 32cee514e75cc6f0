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
