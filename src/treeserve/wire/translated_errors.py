"""A translated chat's error named in the API the user spoke: the Responses or Messages field they
sent, not the chat completions field it became (`max_output_tokens`, not `max_tokens`)."""
from __future__ import annotations

import contextlib
import re

from treeserve.wire.errors import APIError

_AT = r"(?:\.|\[)(\d+)\]?"  # an index: ".0" (pydantic's locations) or "[0]" (ParamError's)
# (a chat field's pattern, the caller's field); the first that matches renames the parameter's start
RESPONSES = [(r"^max_tokens\b", "max_output_tokens"), (r"^response_format\b", "text.format"),
             (rf"^tools{_AT}\.function\.", r"tools[\1]."), (r"^messages\b\S*", "input")]
MESSAGES = [(r"^stop\b", "stop_sequences"), (rf"^tools{_AT}\.function\.parameters\b", r"tools[\1].input_schema"),
            (rf"^tools{_AT}\.function\.", r"tools[\1].")]


def renamed(exc: APIError, rules: list[tuple[str, str]]) -> APIError:
    """`exc` with its parameter (and the message's leading name of it) as the caller's API names it."""
    if not exc.param:
        return exc
    for pattern, replacement in rules:
        param, found = re.subn(pattern, replacement, exc.param, count=1)
        if found:
            message = param + exc.message[len(exc.param):] if exc.message.startswith(exc.param) else exc.message
            return APIError(exc.status, message, param, exc.code, exc.headers)
    return exc


@contextlib.contextmanager
def named_for(rules: list[tuple[str, str]]):
    """The block's APIError raised again with its parameter renamed by `rules`."""
    try:
        yield
    except APIError as exc:
        raise renamed(exc, rules) from exc
