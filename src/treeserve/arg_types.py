"""argparse types the command lines share (`treeserve` and its subcommands, `treeserve bench`): plain text
checks, importing nothing of treeserve, so that every layer that builds a parser may use them."""
from __future__ import annotations

import argparse
import json
import re


def json_object(text: str) -> dict:
    """argparse's type for a JSON object argument (a clear error for anything else)."""
    return _json_of(text, dict, "a JSON object")


def json_list(text: str) -> list[str]:
    """argparse's type for a JSON list of strings (vLLM's `--allowed-origins '["*"]'`)."""
    value = _json_of(text, list, 'a JSON list of strings, e.g. \'["*"]\'')
    if not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. \'["*"]\'')
    return value


def _json_of(text: str, kind: type, what: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); expected {what}") from None
    if not isinstance(value, kind):
        raise argparse.ArgumentTypeError(f"must be {what}")
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


def port(text: str, lowest: int = 0) -> int:
    """argparse's type for a TCP port: 0 (the kernel picks a free one; `lowest` 1 where a client must
    know the port) to 65535."""
    value = whole_number(text)
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, {lowest}-65535, got {value}")
    return value


def model_arg(text: str) -> str:
    """argparse's type for a model argument: an empty or blank one is an error naming the flag (an empty
    path is the current folder, which was then loaded as a model)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"is empty ({text!r}): give a local model directory or builtin:NAME")
    return text


def given(what: str):
    """argparse's type for a value that must not be empty when the flag is given: `what` says what
    to give instead (an empty value was read as the flag left out, and its default used silently)."""
    def non_empty(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"is empty ({text!r}): {what}")
        return text
    return non_empty


# the name requests give as "model" (serve's --served-model-name, bench serve's --model, --chat-router)
served_name = given("give the name requests call the model by, or leave the flag out")
# the gateway's database (gateway, its management commands, chat)
database_url = given("give a SQLAlchemy URL or leave the flag out (then TREESERVE_GATEWAY_DATABASE, else "
                     "./treeserve-gateway.db)")


def broker_url(text: str) -> str:
    """argparse's type for an AMQP URL (one without its scheme was retried every 5 seconds, for ever)."""
    url = with_scheme(text, ("amqp", "amqps"))
    if url is None:
        raise argparse.ArgumentTypeError(f"expected an amqp:// or amqps:// URL such as amqp://guest:guest@host/, "
                                         f"got {without_password(text)!r}")
    return url


def with_scheme(url: str, schemes: tuple[str, ...]) -> str | None:
    """`url` with its scheme in lower case when that is one of `schemes` (lower case, e.g. ("http", "https")),
    else None. A scheme is case-insensitive (RFC 3986, 3.1): AMQP://host is amqp://host, as yarl and httpx read it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        return None
    return f"{scheme.lower()}://{rest}"


# a URL's scheme (if any), its user, and from a colon after it to the last "@" (a password may hold "@", as
# urllib reads one, or "/", as SQLAlchemy does: this URL is wrong, so the widest reading is the safe one)
_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*://)?)([^:/@]*)(?::(.*))?@", re.DOTALL)


def without_password(url: str) -> str:
    """`url` as an error may print it: the password after its user (`user:PASSWORD@`) as *** (`user:***@`), with
    or without a scheme (an error says a URL is wrong, so it may be one urllib cannot split); a user with no
    password (`TOKEN@host`, `TOKEN:@host`) may be the secret itself: `***@`."""
    match = _USERINFO.match(url)
    if match is None:
        return url
    scheme, user, password = match.groups()
    return f"{scheme}{shown_userinfo(user, password)}@{url[match.end():]}"


def shown_userinfo(user: str, password: str | None) -> str:
    """A URL's `user:password` as logs and errors show it: `user:***` (SQLAlchemy's `hide_password`), or `***`
    where there is no password, the user then being what may be a key (pip's `redact_auth_from_url`)."""
    return f"{user}:***" if user and password else "***"
