"""vLLM's score inputs (its `ScoreInput | list[ScoreInput]`): a field of a score body is a string, a
list, or `{"content": [parts]}`, a list's items strings or such objects. Read as vLLM reads them
(its validate_score_input): a string or an object not in a list is one input, as a list of one; an
object is one text, its parts joined by newlines (as a chat message's). The reward models read text
only: a part that is not text (an image, a video, image embeddings) is a 400 naming it, as is
anything else that is none of these, by its place (`text_2[1]`, `documents.content[0]`)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from treeserve.errors import ParamError
from treeserve.wire.chat_messages import TextPart


class ScoreContent(BaseModel):
    """vLLM's ScoreMultiModalParam, of text parts (the only ones a reward model reads)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    content: list[TextPart]


ScoreInputs = str | ScoreContent | list[str | ScoreContent]


def check_inputs(value: Any, field: str) -> None:
    """ParamError naming the place in `value` (the parsed JSON of `field`) that is no score input."""
    if isinstance(value, dict):
        _check_content(value, field)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict):
                _check_content(item, f"{field}[{i}]")
            elif not isinstance(item, str):
                raise ParamError(f"{field}[{i}]", f"each text must be a string, got {json_type(item)}")
    elif not isinstance(value, str):
        raise ParamError(field, f"must be a string, a list of them or {{\"content\": [text parts]}}, "
                                f"got {json_type(value)}")


def _check_content(value: dict, where: str) -> None:
    content = value.get("content")
    if not isinstance(content, list):
        raise ParamError(where, "an object is vLLM's {\"content\": [parts]}, with a list of content parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else f"{json_type(part)} with no type"
            raise ParamError(f"{where}.content[{j}]", f"{what}: only text parts ({{\"type\": \"text\", \"text\": "
                                                      "...}) can be scored (the reward models read text only)")
        if not isinstance(part.get("text"), str):
            raise ParamError(f"{where}.content[{j}].text", f"must be a string, got {json_type(part.get('text'))}")


def texts(value: ScoreInputs, field: str) -> list[tuple[str, str]]:
    """(text, where it came from) per input of a validated field, as vLLM reads them: one input not
    in a list is a list of one."""
    if not isinstance(value, list):
        return [(text(value), field)]
    return [(text(item), f"{field}[{i}]") for i, item in enumerate(value)]


def text(value: str | ScoreContent) -> str:
    """One input's text: a string, or an object's text parts joined by newlines."""
    return value if isinstance(value, str) else "\n".join(part.text for part in value.content)


def json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null", str: "a string"}.get(type(value), type(value).__name__)
