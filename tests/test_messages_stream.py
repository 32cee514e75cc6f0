"""Anthropic Messages events made of chat chunks (wire/messages_stream.py), against the whole reply
made of the same chat reply (wire/messages.py's from_chat): a stream and a whole reply agree."""
from __future__ import annotations

from stream_support import CALL, chunk, run_events
from treeserve.wire.messages import MessagesRequest, from_chat
from treeserve.wire.messages_stream import MessageEvents


def _events(chunks: list[dict]) -> list[dict]:
    events = MessageEvents(MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]), "m")
    return run_events(events, chunks)


def _blocks(events: list[dict]) -> list[dict]:
    return [e["content_block"] for e in events if e["type"] == "content_block_start"]


def test_a_stream_cut_by_max_tokens_in_a_call_has_its_tool_use_block_as_the_whole_reply():
    """A call cut by max_tokens is kept, whole and streamed (Anthropic's reply ends `max_tokens` with the
    tool_use block incomplete): the stream dropped one cut before its arguments, and the whole reply
    one cut after some of them."""
    request = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    fragment = {"index": 0, "function": {"arguments": '{"city": '}}
    for fragments, arguments in (([], ""), ([chunk({"tool_calls": [fragment]})], '{"city": ')):
        events = _events([chunk({"content": "Let me look."}), chunk({"tool_calls": [CALL]})] + fragments
                         + [chunk(finish="length")])
        call = CALL | {"function": {"name": "weather", "arguments": arguments}}
        whole = from_chat(request, "m", {"choices": [{"message": {"role": "assistant", "content": "Let me look.",
                                                                  "tool_calls": [call]}, "finish_reason": "length"}]})
        assert [b["type"] for b in _blocks(events)] == [b["type"] for b in whole["content"]] == ["text", "tool_use"]
        assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
        delta = next(e for e in events if e["type"] == "message_delta")
        assert delta["delta"]["stop_reason"] == whole["stop_reason"] == "max_tokens"


def test_a_call_with_arguments_or_a_finished_call_still_opens_its_tool_use_block():
    fragment = {"index": 0, "function": {"arguments": '{"city": '}}
    cut = _events([chunk({"tool_calls": [CALL]}), chunk({"tool_calls": [fragment]}), chunk(finish="length")])
    assert [b["type"] for b in _blocks(cut)] == ["tool_use"]
    assert [e["delta"]["partial_json"] for e in cut if e["type"] == "content_block_delta"] == ['{"city": ']
    finished = _events([chunk({"tool_calls": [CALL]}), chunk(finish="tool_calls")])  # a call with no arguments
    assert [(b["type"], b["name"]) for b in _blocks(finished)] == [("tool_use", "weather")]
    assert next(e for e in finished if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
    two = _events([chunk({"tool_calls": [CALL]}), chunk({"tool_calls": [CALL | {"index": 1, "id": "call_2"}]}),
                   chunk(finish="tool_calls")])
    assert [(b["id"], e["index"]) for e in two if e["type"] == "content_block_start"
            for b in [e["content_block"]]] == [("call_1", 0), ("call_2", 1)]


def test_a_cut_calls_input_in_the_whole_reply_is_what_the_sdk_reads_from_the_stream():
    """A tool_use block cut by max_tokens: the whole reply's `input` (an object) holds the arguments as far
    as they went, as Anthropic's SDK reads the streamed block's `partial_json` (jiter's partial mode). Before:
    `{}` whole, while the stream's client got the members already written."""
    import jiter
    request = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    for arguments, expected in (('{"city": "Paris", "days": [1, 2', {"city": "Paris", "days": [1, 2]}),
                                ('{"city": "Paris", "unit": "cel', {"city": "Paris"}),
                                ('{"n": -1.5e', {}), ('{"a": {"b": [true, nu', {"a": {"b": [True]}}), ("", {})):
        fragment = {"index": 0, "function": {"arguments": arguments}}
        events = _events([chunk({"tool_calls": [CALL]}), chunk({"tool_calls": [fragment]}), chunk(finish="length")])
        streamed = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
        call = CALL | {"function": {"name": "weather", "arguments": arguments}}
        whole = from_chat(request, "m", {"choices": [{"message": {"role": "assistant", "content": None,
                                                                  "tool_calls": [call]}, "finish_reason": "length"}]})
        sdk = jiter.from_json(streamed.encode(), partial_mode=True) if streamed else {}
        assert whole["content"][0]["input"] == sdk == expected, (arguments, whole["content"], sdk)
