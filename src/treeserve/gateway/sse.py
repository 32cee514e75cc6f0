"""Relaying a backend's server-sent events to the client, reading the usage on the way.

The gateway asks backends for usage in every chunk (`continuous_usage_stats`) so that a stream cut
short is billed for what its client got; the client sees usage only where it asked for it. Usage
is normally the chunk's last field (vLLM and treeserve write it so): then it is read and cut out of
the bytes directly, without decoding and re-encoding the whole chunk; anything else takes the slow
path (a full JSON round trip). Events that arrived in one read are relayed in one write."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from treeserve.gateway.usage import Usage, malformed_usage, read_usage

DONE = b"data: [DONE]\n\n"
USAGE = b'"usage"'


@dataclass
class StreamState:
    """What the client asked for, and what it has been sent so far."""
    include_usage: bool
    continuous_usage: bool
    backend: str = ""             # its name, for the log
    usage: Usage = field(default_factory=Usage)
    counted_chunks: int = 0       # content chunks, for a backend that reports no usage
    usage_reported: bool = False
    done: bool = False            # [DONE] was relayed: the client has the whole answer
    malformed_logged: bool = False  # a malformed usage is logged once a stream

    def relay(self, payloads: list[bytes]) -> bytes:
        """The client's bytes for these events (possibly none)."""
        return b"".join(filter(None, map(self.client_event, payloads)))

    def billed(self) -> Usage:
        return self.usage if self.usage_reported else Usage(0, self.counted_chunks)

    def client_event(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            self.done = True
            return DONE
        fast = self._usage_last(payload)
        if fast is None:
            return self._slow(payload)
        usage, cut = fast
        self._record(usage)
        if b'"choices"' not in payload:  # not a completion chunk (a search's result): relayed as it is
            return _event(payload)
        if b'"choices": []' in payload or b'"choices":[]' in payload:  # the usage-only chunk at the end
            return _event(payload) if self.include_usage else None
        if self.include_usage and self.continuous_usage:
            return _event(payload)
        return _event(payload[:cut] + b"}")

    def _usage_last(self, payload: bytes) -> tuple[dict, int] | None:
        """(usage, where the field's comma is) when usage is the chunk's last field, else None."""
        at = payload.rfind(USAGE)
        if at < 0 or not payload.endswith(b"}"):
            return None
        comma = payload.rfind(b",", 0, at)
        colon = payload.find(b":", at + len(USAGE))
        if comma < 0 or colon < 0 or payload[comma + 1:at].strip() or payload[at + len(USAGE):colon].strip():
            return None
        try:
            usage = json.loads(payload[colon + 1:-1])
        except ValueError:
            return None
        return (usage, comma) if isinstance(usage, dict) else None

    def _slow(self, payload: bytes) -> bytes | None:
        try:
            event = json.loads(payload)
        except ValueError:
            return _event(payload)
        if not isinstance(event, dict):
            return _event(payload)
        if isinstance(event.get("usage"), dict):
            self._record(event["usage"])
        elif not self.usage_reported:
            self._count(event)
        if "usage" not in event or "choices" not in event:  # (a search's result carries usage, and no choices)
            return _event(payload)
        if not event["choices"]:
            return _event(payload) if self.include_usage else None
        if self.include_usage and self.continuous_usage:
            return _event(payload)
        event.pop("usage")
        return _event(json.dumps(event, separators=(",", ":")).encode())

    def _record(self, usage: dict) -> None:
        self.usage, clean = read_usage(usage)
        self.usage_reported = True
        if not clean and not self.malformed_logged:
            self.malformed_logged = True
            malformed_usage(self.backend, usage)

    def _count(self, event: dict) -> None:
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():  # (a malformed chunk counts nothing)
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(choice, dict) and ((isinstance(delta, dict) and delta.get("content")) or choice.get("text")):
                self.counted_chunks += 1


class SSESplitter:
    """Cuts a byte stream into the `data:` payloads of its events, whatever the pieces (lines of
    any length, events across pieces, CRLF or LF)."""

    def __init__(self):
        self.data: list[bytes] = []
        self.pending = b""

    def feed(self, piece: bytes) -> list[bytes]:
        lines = (self.pending + piece).split(b"\n")
        self.pending = lines.pop()
        events = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if line.startswith(b"data:"):
                self.data.append(line[5:].lstrip())
            elif not line and self.data:
                events.append(b"\n".join(self.data))
                self.data = []
        return events

    def finish(self) -> list[bytes]:
        if self.pending.startswith(b"data:"):
            self.data.append(self.pending[5:].strip())
        self.pending = b""
        events, self.data = ([b"\n".join(self.data)] if self.data else []), []
        return events


async def event_batches(response: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
    """The payloads of an HTTP stream's events, grouped by the read they completed in."""
    splitter = SSESplitter()
    async for piece in response.content.iter_any():
        events = splitter.feed(piece)
        if events:
            yield events
    events = splitter.finish()
    if events:
        yield events


def error_event(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    return _event(json.dumps(body, separators=(",", ":")).encode())


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
