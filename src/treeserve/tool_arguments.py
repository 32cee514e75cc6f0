"""A tool call's arguments as chat templates read them: OpenAI's JSON text made the object HF
templates expect (the server's and the offline `LLM.chat`'s messages alike)."""
from __future__ import annotations

import json

from treeserve.errors import ParamError


def parse_arguments(text: str, where: str) -> dict:
    """The JSON object `text` holds; ParamError naming `where` (a call's path in the messages) else."""
    try:
        arguments = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ParamError(f"{where}.function.arguments", f"must be JSON text ({exc})") from None
    if not isinstance(arguments, dict):
        raise ParamError(f"{where}.function.arguments", "must be a JSON object")
    return arguments
