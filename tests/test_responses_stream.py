"""Responses API events made of chat chunks (wire/responses_stream.py), against the whole response
made of the same chat reply (wire/responses.py's from_chat): a stream and a whole response agree."""
from __future__ import annotations

from stream_support import CALL, chunk, run_events
from treeserve.wire.responses import ResponsesRequest, from_chat, skeleton
from treeserve.wire.responses_stream import ResponseEvents


def _skeleton() -> dict:
    return skeleton(ResponsesRequest(input="Hi"), "resp_1", "m")


def _events(chunks: list[dict]) -> list[dict]:
    events = ResponseEvents(_skeleton())
    return run_events(events, chunks)


def _added(events: list[dict]) -> list[dict]:
    return [e["item"] for e in events if e["type"] == "response.output_item.added"]


def _whole(message: dict, finish: str) -> dict:
    return from_chat(_skeleton(), {"choices": [{"message": {"role": "assistant"} | message, "finish_reason": finish}]})


def _shape(output: list[dict]) -> list[tuple]:
    return [(item["type"], item["status"]) for item in output]


def test_a_stream_cut_by_max_output_tokens_in_a_call_has_its_function_call_item_as_the_whole_response():
    """A call cut by max_output_tokens is kept, whole and streamed, its item `incomplete` (OpenAI's reply
    keeps a cut call, its arguments cut short): the stream dropped one cut before its arguments, and the
    whole response one cut after some of them."""
    fragment = {"index": 0, "function": {"arguments": '{"city": '}}
    for fragments, arguments in (([], ""), ([chunk({"tool_calls": [fragment]})], '{"city": ')):
        events = _events([chunk({"content": "Let me look."}), chunk({"tool_calls": [CALL]})] + fragments
                         + [chunk(finish="length")])
        call = CALL | {"function": {"name": "weather", "arguments": arguments}}
        whole = _whole({"content": "Let me look.", "tool_calls": [call]}, "length")
        last = events[-1]
        assert last["type"] == "response.incomplete"
        assert [item["type"] for item in _added(events)] == ["message", "function_call"]
        expected = [("message", "completed"), ("function_call", "incomplete")]
        assert _shape(last["response"]["output"]) == _shape(whole["output"]) == expected
        assert last["response"]["output"][1]["arguments"] == whole["output"][1]["arguments"] == arguments
    alone = _events([chunk({"tool_calls": [CALL]}), chunk(finish="length")])  # no text before the call
    empty = _whole({"content": None, "tool_calls": [CALL]}, "length")
    assert _shape(alone[-1]["response"]["output"]) == _shape(empty["output"]) == [("function_call", "incomplete")]
    assert [e["output_index"] for e in alone if e["type"] == "response.output_item.done"] == [0]


def test_a_call_with_arguments_or_a_finished_call_still_has_its_function_call_item():
    fragment = {"index": 0, "function": {"arguments": '{"city": '}}
    cut = _events([chunk({"tool_calls": [CALL]}), chunk({"tool_calls": [fragment]}), chunk(finish="length")])
    assert [item["type"] for item in _added(cut)] == ["function_call"]
    assert [e["delta"] for e in cut if e["type"] == "response.function_call_arguments.delta"] == ['{"city": ']
    finished = _events([chunk({"tool_calls": [CALL]}), chunk(finish="tool_calls")])  # a call with no arguments
    whole = _whole({"content": None, "tool_calls": [CALL]}, "tool_calls")
    assert [(i["type"], i["name"]) for i in finished[-1]["response"]["output"]] == [("function_call", "weather")]
    assert _shape(finished[-1]["response"]["output"]) == _shape(whole["output"])
    two = _events([chunk({"content": "Two."}), chunk({"tool_calls": [CALL]}),
                   chunk({"tool_calls": [CALL | {"index": 1, "id": "call_2"}]}), chunk(finish="tool_calls")])
    assert [(i.get("call_id"), e["output_index"]) for e in two if e["type"] == "response.output_item.added"
            for i in [e["item"]]] == [(None, 0), ("call_1", 1), ("call_2", 2)]
    numbers = [e["sequence_number"] for e in two]
    assert numbers == list(range(len(numbers)))
