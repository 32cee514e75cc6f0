"""Virtual keys: made from the system's CSPRNG, shown once, stored as their SHA-256.

A key carries 256 random bits, so a fast hash is the right one (passwords, which are guessable,
get a slow hash instead): nobody can search that space, and each request checks its key in
microseconds."""
from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets

PREFIX = "sk-"
_DURATION = re.compile(r"^\s*(\d+)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def display_name(token: str) -> str:
    return f"{token[:3]}...{token[-4:]}"


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def parse_duration(text: str, param: str) -> dt.timedelta:
    """'30s', '15m', '12h', '30d', '2w' (LiteLLM's spelling of durations and budget periods)."""
    from treeserve.errors import ParamError

    match = _DURATION.match(text or "")
    if not match or int(match.group(1)) == 0:
        raise ParamError(param, f"{param}: expected a duration such as '30s', '15m', '12h', '30d' or '2w', "
                         f"got {text!r}")
    return dt.timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
