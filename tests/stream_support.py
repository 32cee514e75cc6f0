"""Chat chunks fed to a translated stream (wire/translated_stream.py's converters), for the tests that
hold a stream against the whole reply made of the same chat answer."""
from __future__ import annotations

CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}


def run_events(events, chunks: list[dict]) -> list[dict]:
    """Every event a converter makes: its start, each chunk fed, its finish."""
    out = events.start(None)
    for chunk in chunks:
        out += events.feed(chunk)
    return out + events.finish()


def chunk(delta: dict | None = None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
