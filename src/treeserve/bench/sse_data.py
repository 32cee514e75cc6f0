"""The `data:` payloads of a server-sent event stream as a client reads it, split on newlines only:
httpx's `iter_lines` also splits on U+2028, U+0085 and the like, which JSON text may hold raw (a
model's output), and would cut an event in two."""
from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator


class DataLines:
    """Text chunks in, the `data:` payloads of the lines they complete out."""

    def __init__(self):
        self.buffer = ""

    def feed(self, chunk: str) -> list[str]:
        *lines, self.buffer = (self.buffer + chunk).split("\n")
        return [line[len("data:"):].strip() for line in lines if line.startswith("data:")]


def sse_data(chunks: Iterable[str]) -> Iterator[str]:
    lines = DataLines()
    for chunk in chunks:
        yield from lines.feed(chunk)


async def asse_data(chunks: AsyncIterable[str]) -> AsyncIterator[str]:
    lines = DataLines()
    async for chunk in chunks:
        for data in lines.feed(chunk):
            yield data
