"""A JSON object cut short (a tool call's arguments that max_tokens cut), read as far as it went."""
from __future__ import annotations

import json
from collections import deque

_CLOSERS = {"{": "}", "[": "]"}
# cut points tried, the last first: a prefix of JSON fails only for its unfinished last member (a key and
# its colon, say: a few tries); text that is no JSON at all is not read back far (nor in quadratic time)
MAX_TRIES = 32
_SCALAR = set("0123456789+-.eE") | set("truefalsn")  # the characters of a number or a literal


def partial_object(text: str) -> dict:
    """The object `text` (JSON cut short) holds: its members as far as they are complete, containers
    still open closed, an unfinished string, number, literal or key dropped, as Anthropic's SDK reads
    a streamed tool_use block's `input` (jiter's partial mode); {} when nothing of an object is there."""
    for end, opened in reversed(_cut_points(text)):
        try:
            value = json.loads(text[:end].rstrip().rstrip(",") + _closers(opened))
        except (ValueError, RecursionError):  # (nesting deeper than json's recursion goes)
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _cut_points(text: str) -> deque:
    """The last MAX_TRIES places where `text` may be cut outside a string, number or literal: (the
    prefix's end, the containers it leaves open: a linked stack, (closer, the stack below) or None)."""
    points, opened, in_string, escaped = deque(maxlen=MAX_TRIES), None, False, False
    for i, char in enumerate(text):
        if in_string:
            in_string, escaped = (char != '"' or escaped), (char == "\\" and not escaped)
        elif char == '"':
            in_string = True
        elif char in _CLOSERS:
            opened = (_CLOSERS[char], opened)
        elif char in "}]" and opened is not None:
            opened = opened[1]
        if not in_string and not _inside_scalar(text, i):
            points.append((i + 1, opened))
    return points


def _closers(opened: tuple | None) -> str:
    closers = []
    while opened is not None:
        closers.append(opened[0])
        opened = opened[1]
    return "".join(closers)


def _inside_scalar(text: str, i: int) -> bool:
    """Whether a cut after text[i] falls inside a number or literal that goes on (`1.` of `1.5`)."""
    return i + 1 < len(text) and text[i] in _SCALAR and text[i + 1] in _SCALAR
