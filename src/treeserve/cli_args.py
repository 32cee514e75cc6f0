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



def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def at_least_one(text: str) -> int:
    """argparse's type for a count of at least 1."""
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """argparse's type for a TCP port: 0 (the kernel picks a free one) to 65535."""
    value = whole_number(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0-65535, got {value}")
    return value
