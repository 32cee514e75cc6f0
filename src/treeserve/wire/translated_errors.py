"""A translated chat's error named in the API the user spoke: the Responses or Messages field they
sent, not the chat completions field it became (`max_output_tokens`, not `max_tokens`)."""
from __future__ import annotations

import contextlib
import re

from treeserve.wire.errors import APIError

_AT = r"(?:\.|\[)(\d+)\]?"  # an index: ".0" (pydantic's locations) or "[0]" (ParamError's)
# (a chat field's pattern, the caller's field); the first that matches renames the parameter's start
RESPONSES = [(r"^max_tokens\b", "max_output_tokens"), (r"^response_format\b", "text.format"),
             (rf"^tools{_AT}\.function\.", r"tools[\1]."), (r"^tool_choice\.function\.name\b", "tool_choice.name"),
             (rf"^tool_choice\.allowed_tools\.tools{_AT}\.function\.name\b", r"tool_choice.tools[\1].name"),
             (r"^tool_choice\.allowed_tools\.", "tool_choice."), (r"^messages\b\S*", "input")]
MESSAGES = [(r"^stop\b", "stop_sequences"), (r"^response_format\b", "output_config.format"),
            (rf"^tools{_AT}\.function\.parameters\b", r"tools[\1].input_schema"),
            (rf"^tools{_AT}\.function\.", r"tools[\1]."), (r"^tool_choice\.function\.name\b", "tool_choice.name")]


def renamed(exc: APIError, rules: list[tuple[str, str]]) -> APIError:
    """`exc` with its parameter (and the message's leading name of it) as the caller's API names it,
    and the other chat fields its message names too."""
    if not exc.param:
        return exc
    param = exc.param
    for pattern, replacement in rules:
        param, found = re.subn(pattern, replacement, exc.param, count=1)
        if found:
            break
    message, rest = exc.message, exc.message
    if message.startswith(exc.param):
        message, rest = param, message[len(exc.param):]
    else:
        message = ""
    message += _fields_renamed(rest, rules)
    if (param, message) == (exc.param, exc.message):
        return exc
    return APIError(exc.status, message, param, exc.code, exc.headers, exc.error_type)


def _fields_renamed(text: str, rules: list[tuple[str, str]]) -> str:
    """The chat fields a message names after its parameter (`response_format cannot be combined
    with ...`), renamed by the rules that name one field (no index to carry; a plain word such as
    `stop` is left alone: it may be English)."""
    for pattern, replacement in rules:
        field = pattern.removeprefix("^").removesuffix("\\b")
        if "\\" not in replacement and re.fullmatch(r"[a-z]+_[a-z_.]+", field.replace("\\.", ".")):
            text = re.sub(r"(?<![\w.])" + pattern.removeprefix("^"), replacement, text)
    return text


@contextlib.contextmanager
def named_for(rules: list[tuple[str, str]]):
    """The block's APIError raised again with its parameter renamed by `rules`."""
    try:
        yield
    except APIError as exc:
        raise renamed(exc, rules) from exc
