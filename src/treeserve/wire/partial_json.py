"""A JSON object cut short (a tool call's arguments that max_tokens cut), read as far as it went."""
from __future__ import annotations

import json

_CLOSERS = {"{": "}", "[": "]"}
_SCALAR = set("0123456789+-.eE") | set("truefalsn")  # the characters of a number or a literal


def partial_object(text: str) -> dict:
    """The object `text` (JSON cut short) holds: its members as far as they are complete, containers
    still open closed, an unfinished string, number, literal or key dropped, as Anthropic's SDK reads
    a streamed tool_use block's `input` (jiter's partial mode); {} when nothing of an object is there."""
    for prefix, closers in reversed(_cut_points(text)):
        try:
            value = json.loads(prefix.rstrip().rstrip(",") + closers)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _cut_points(text: str) -> list[tuple[str, str]]:
    """(a prefix of `text` that ends outside a string, the closers of the containers it leaves open)."""
    points, stack, in_string, escaped = [], [], False, False
    for i, char in enumerate(text):
        if in_string:
            in_string, escaped = (char != '"' or escaped), (char == "\\" and not escaped)
        elif char == '"':
            in_string = True
        elif char in _CLOSERS:
            stack.append(_CLOSERS[char])
        elif char in "}]" and stack:
            stack.pop()
        if not in_string and not _inside_scalar(text, i):
            points.append((text[:i + 1], "".join(reversed(stack))))
    return points


def _inside_scalar(text: str, i: int) -> bool:
    """Whether a cut after text[i] falls inside a number or literal that goes on (`1.` of `1.5`)."""
    return i + 1 < len(text) and text[i] in _SCALAR and text[i + 1] in _SCALAR
