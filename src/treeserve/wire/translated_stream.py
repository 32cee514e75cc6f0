"""A streamed chat reply relayed as another API's events (wire/responses_stream.py's ResponseEvents,
wire/messages_stream.py's MessageEvents): each converter turns chunks into events (`start`, `feed`,
`finish`, `fail`); this writes them on the wire, and closes the chat stream however it ends."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse

from treeserve import jsonl
from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.translated")


class ChunkEvents(ABC):
    """A converter's reading of chat chunks: usage, each text delta (`_text`), each tool-call delta
    (`_call`) and the finish, in order; subclasses make their API's events of them."""
    usage: dict | None = None
    finish_reason: str | None = None
    stop_reason = None  # the stop string met (vLLM's field), when one ended the reply

    def opens(self, chunk: dict) -> bool:
        """Whether the opening events go with this chunk (its `start`): the first one, unless a
        converter waits for what a later one knows."""
        return True

    def feed(self, chunk: dict) -> list[dict]:
        """The events for one chat chunk."""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return events

    @abstractmethod
    def _text(self, text: str) -> list[dict]:
        """The events for a text delta."""

    @abstractmethod
    def _call(self, delta: dict) -> list[dict]:
        """The events for a tool call's delta (its announcement, or a fragment of its arguments)."""


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The HTTP response of a translated stream (not buffered by a proxy on the way)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse(event: dict) -> str:
    """One event on the wire: its type as the SSE event name, as OpenAI's and Anthropic's servers write them."""
    return f"event: {event['type']}\ndata: {jsonl.line(event, compact=True)}\n\n"


async def translated_events(events, chunks: AsyncIterator[dict],
                            before_end: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[str]:
    """`before_end` runs once the reply is whole, or has failed, before its last events are sent (a
    response is stored before its client reads `response.completed`, or `response.failed`). The
    opening events go with the chunk the converter `opens` with (what it knows, its prompt's usage, is
    in them), or before a failure or end that came first."""
    started = False
    try:
        async for chunk in chunks:
            if not started and events.opens(chunk):
                started = True
                for event in events.start(chunk):
                    yield sse(event)
            for event in events.feed(chunk):
                yield sse(event)
    except Exception as exc:  # (a client gone is GeneratorExit/CancelledError, not caught here)
        failure = [] if started else events.start(None)
        if isinstance(exc, APIError):
            failure += events.fail(exc.status, exc.message, exc.code)
        else:
            log.exception("a translated stream failed")
            failure += events.fail(500, f"internal error: {type(exc).__name__}", "server_error")
        if before_end is not None:
            try:
                await before_end()
            except Exception:  # (the failure is told all the same)
                log.exception("keeping a failed translated stream failed")
        for event in failure:
            yield sse(event)
        return
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    if not started:
        for event in events.start(None):
            yield sse(event)
    last = events.finish()
    if before_end is not None:
        await before_end()
    for event in last:
        yield sse(event)
