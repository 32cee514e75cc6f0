"""Relaying streamed events: usage read from every chunk (fast path: usage as the last field; any
other shape: a full JSON round trip), shown to the client only where it asked; events split across
reads or arriving together."""
from __future__ import annotations

import asyncio
import json

import pytest

from treeserve.gateway.sse import StreamState, event_batches


def _chunk(text, usage, spaced=True, usage_last=True, choices=True):
    event = {"id": "c1", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}] if choices else []}
    if usage is not None:
        u = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage,
             "prompt_tokens_details": {"cached_tokens": 0}}
        event = ({**event, "usage": u} if usage_last else {"usage": u, **event})
    return json.dumps(event, separators=(", ", ": ") if spaced else (",", ":")).encode()


def _client_events(out: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]


@pytest.mark.parametrize("spaced", [True, False])
@pytest.mark.parametrize("usage_last", [True, False])
@pytest.mark.parametrize("include, continuous", [(False, False), (True, False), (True, True)])
def test_usage_is_read_from_every_chunk_and_shown_as_asked(spaced, usage_last, include, continuous):
    state = StreamState(include, continuous)
    texts = ['say "usage": {}', "x", 'quote "usage"']
    payloads = [_chunk(t, i + 1, spaced, usage_last) for i, t in enumerate(texts)]
    payloads.append(_chunk(None, 3, spaced, usage_last, choices=False))
    out = state.relay(payloads[:2]) + state.relay(payloads[2:]) + state.relay([b"[DONE]"])
    events = _client_events(out)
    assert [e["choices"][0]["delta"]["content"] for e in events if e["choices"]] == texts
    assert state.billed().completion_tokens == 3 and state.billed().prompt_tokens == 5
    with_usage = [e for e in events if "usage" in e]
    if not include:
        assert not with_usage and len(events) == 3
    elif continuous:
        assert [e["usage"]["completion_tokens"] for e in with_usage] == [1, 2, 3, 3]
    else:
        assert len(with_usage) == 1 and not with_usage[0]["choices"]
    assert out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("usage_last", [True, False])
def test_a_streamed_search_result_reaches_the_client_whole(usage_last):
    """A search's last event carries usage and no choices: it is the answer, not a usage chunk."""
    usage = {"completion_tokens": 42}
    result = {"object": "search.result", "answer": "18", "candidates": [{"index": 0, "text": "..."}]}
    result = {**result, "usage": usage, "seconds": 0.5} if not usage_last else {**result, "usage": usage}
    progress = {"object": "search.progress", "iteration": 1, "live_beams": 4}
    state = StreamState(False, False)
    out = state.relay([json.dumps(progress).encode(), json.dumps(result).encode(), b"[DONE]"])
    assert _client_events(out) == [progress, result]
    assert state.billed().completion_tokens == 42


def test_without_usage_the_content_chunks_are_counted():
    state = StreamState(False, False)
    out = state.relay([_chunk("a", None), _chunk("b", None), b"not json", b"[DONE]"])
    assert state.billed().completion_tokens == 2 and b"data: not json\n\n" in out


def test_events_are_batched_by_the_read_they_completed_in():
    class Content:
        def __init__(self, pieces):
            self.pieces = pieces

        async def iter_any(self):
            for piece in self.pieces:
                yield piece

    class Response:
        def __init__(self, pieces):
            self.content = Content(pieces)

    stream = b"data: one\n\ndata: two\r\n\r\ndata: th" + b"r" * 100_000 + b"ee\n\n: comment\n\ndata: [DONE]\n\n"
    pieces = [stream[:5], stream[5:30], stream[30:70_000], stream[70_000:]]

    async def collect():
        return [batch async for batch in event_batches(Response(pieces))]

    batches = asyncio.run(collect())
    assert batches[0] == [b"one", b"two"] and batches[-1][-1] == b"[DONE]"
    assert [p for b in batches for p in b][2] == b"th" + b"r" * 100_000 + b"ee"
