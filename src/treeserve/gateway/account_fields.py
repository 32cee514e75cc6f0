"""The fields of keys and users: what an admin may set (checked before anything is written) and what
the admin API shows of a row."""
from __future__ import annotations

import datetime as dt
import math

from treeserve.errors import ParamError
from treeserve.gateway.fields import INT32_MAX
from treeserve.gateway.keys import after
from treeserve.gateway.schema import ApiKey, User, iso, money

KEY_FIELDS = ("key_alias", "user_id", "team_id", "models", "max_budget", "soft_budget", "budget_duration", "rpm_limit", "tpm_limit",
              "max_parallel_requests", "metadata", "blocked")
USER_FIELDS = ("max_budget", "budget_duration", "models", "metadata")
LIMITS = ("max_budget", "soft_budget", "rpm_limit", "tpm_limit", "max_parallel_requests", "spend")
COUNTS = ("rpm_limit", "tpm_limit", "max_parallel_requests")


def key_values(fields: dict, now: dt.datetime) -> dict:
    """A key's columns from the fields given (`duration` is the caller's to read)."""
    _refuse_unknown(fields, KEY_FIELDS + ("duration", "spend"), "key")
    values = {k: v for k, v in fields.items() if k in KEY_FIELDS + ("spend",) and k != "metadata"}
    if "metadata" in fields:
        values["extra"] = fields["metadata"] or {}
    _check_limits(values)
    _budget_period(values, now)
    return values


def user_values(fields: dict, now: dt.datetime, updating: bool = False) -> dict:
    """A user's columns from the fields given (`updating`: only those given, `spend` among them)."""
    _refuse_unknown(fields, USER_FIELDS + (("spend",) if updating else ()), "user")
    values = {k: v for k, v in fields.items() if k != "metadata"}
    if "metadata" in fields or not updating:
        values["extra"] = fields.get("metadata") or {}
    _check_limits(values)
    _budget_period(values, now)
    return values


def _refuse_unknown(fields: dict, known: tuple[str, ...], owner: str) -> None:
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ParamError(unknown[0], f"{unknown[0]}: not a {owner} field")


def _check_limits(values: dict) -> None:
    """What the admin API's fields take, for every writer (the command line's too): an amount a finite
    number >= 0 (an infinite one was stored, and every answer naming its key then failed to serialize;
    NaN read as no budget), a count a whole number an INTEGER column holds."""
    for name in LIMITS:
        value = values.get(name)
        if value is None:
            continue
        if not math.isfinite(value):
            raise ParamError(name, f"must be a finite number, got {value}")
        if value < 0:
            raise ParamError(name, f"must be at least 0, got {value}")
        if name in COUNTS and value > INT32_MAX:
            raise ParamError(name, f"must be at most {INT32_MAX}, got {value}")


def _budget_period(values: dict, now: dt.datetime) -> None:
    """A budget period set starts now; one cleared stops resetting."""
    if "budget_duration" in values:
        duration = values["budget_duration"]
        values["budget_reset_at"] = after(now, duration, "budget_duration") if duration else None


def public_key(key: ApiKey) -> dict:
    return {"token": key.token_hash, "key_id": key.id, "key_name": key.key_name, "key_alias": key.key_alias, "user_id": key.user_id,
            "team_id": key.team_id,
            "models": key.models or [], "max_budget": key.max_budget, "soft_budget": key.soft_budget, "spend": money(key.spend), "reserved": money(key.reserved),
            "budget_duration": key.budget_duration, "budget_reset_at": iso(key.budget_reset_at),
            "rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit,
            "max_parallel_requests": key.max_parallel_requests, "expires": iso(key.expires_at),
            "blocked": key.blocked, "metadata": key.extra or {}, "created_at": iso(key.created_at)}


def public_user(user: User) -> dict:
    return {"user_id": user.user_id, "max_budget": user.max_budget, "spend": money(user.spend),
            "reserved": money(user.reserved),
            "budget_duration": user.budget_duration, "budget_reset_at": iso(user.budget_reset_at),
            "models": user.models or [], "metadata": user.extra or {}, "created_at": iso(user.created_at)}
