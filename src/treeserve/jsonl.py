"""JSON text a line at a time: JSON Lines files and server-sent events.

Lines end at "\n" (or "\r\n") alone. `str.splitlines`, and httpx's `iter_lines` built on the same
rule, also break at U+2028, U+2029 and U+0085, which a JSON string may hold raw: a model's
generated text can (a CI run's batch output record split in two at one). So readers here split
at "\n", and writers escape those three, so that any reader's splitter gets whole records back."""
from __future__ import annotations

import json

_SPLITTERS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}  # (json escapes the rest: < U+0020)


def line(value, compact: bool = False) -> str:
    """`value` as one line of JSON, UTF-8 text kept as it is, the three splitters above escaped."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None)
    for raw, escaped in _SPLITTERS.items():
        if raw in text:
            text = text.replace(raw, escaped)
    return text


def dumps(records) -> str:
    """A JSON Lines file: each record on its own line."""
    return "".join(line(record) + "\n" for record in records)


def split(text: str) -> list[tuple[int, str]]:
    """(line number from 1, line) of each line of a JSON Lines file that is not blank."""
    return [(number, row.removesuffix("\r")) for number, row in enumerate(text.split("\n"), start=1)
            if row.strip()]


def loads(text: str) -> list:
    return [json.loads(row) for _, row in split(text)]
