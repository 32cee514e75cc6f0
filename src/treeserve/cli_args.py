"""Argument types the command lines share."""
from __future__ import annotations

import argparse
import json


def json_object(text: str) -> dict:
    """argparse's type for a JSON object argument (a clear error for anything else)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
