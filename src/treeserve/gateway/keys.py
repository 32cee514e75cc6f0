"""Virtual keys: made from the system's CSPRNG, shown once, stored as their SHA-256; and the
`KeyRecord` a request carries (its key's limits, read once per request).

A key carries 256 random bits, so a fast hash is the right one (passwords, which are guessable,
get a slow hash instead): nobody can search that space, and each request checks its key in
microseconds."""
from __future__ import annotations

import calendar
import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from treeserve.gateway.schema import utcnow
from treeserve.gateway.settlement import Reservation

PREFIX = "sk-"
MASTER_LABEL = "master"  # how metrics and logs name the master key (no key may take it as its alias)
_DURATION = re.compile(r"^\s*(\d+)\s*(mo|s|m|h|d|w)\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def has_expired(expires_at: dt.datetime | None) -> bool:
    """Whether a key with this expiry (timezone-aware; None: never) has expired."""
    return expires_at is not None and expires_at <= utcnow()


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


# A secret of the admin's choosing (/key/generate's `key`, /key/regenerate's `new_key`): `sk-` then
# characters an `Authorization: Bearer` header carries and the gateway reads back as sent (visible ASCII,
# no spaces: a space at its end, or a character past ASCII, made a key that no request could use),
# at least CHOSEN_MIN_CHARS of them: the key's name (`sk-...` and its last four) is shown in every
# listing, metric and log line, and of `sk-1234` it showed all.
CHOSEN_MIN_CHARS = 16
_CHOSEN = re.compile(r"[\x21-\x7e]+")


def check_chosen_key(token: str) -> str:
    """`token` if it may be a key's secret; else ValueError saying why (never the secret itself)."""
    rest = token[len(PREFIX):] if token.startswith(PREFIX) else None
    if rest is None or len(rest) < CHOSEN_MIN_CHARS or not _CHOSEN.fullmatch(rest):
        raise ValueError(f"must be {PREFIX!r} then at least {CHOSEN_MIN_CHARS} visible ASCII characters, "
                         f"no spaces (got {len(token)} characters)")
    return token


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def stored_hash(token_or_hash: str) -> str:
    """The stored hash of a key named by the key or by that hash (admin routes take either, as LiteLLM's do)."""
    is_hash = len(token_or_hash) == 64 and all(c in "0123456789abcdef" for c in token_or_hash)
    return token_or_hash if is_hash else hash_key(token_or_hash)


def display_name(token: str) -> str:
    return f"{token[:3]}...{token[-4:]}"


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


MAX_DURATION = dt.timedelta(days=100 * 365)  # a key's lifetime or a budget period (dates stay in range)


def after(start: dt.datetime, text: str, param: str) -> dt.datetime:
    """The moment a duration after `start`: '30s', '15m', '12h', '30d', '2w', or '1mo' (calendar
    months: the same day of the month, or its last day when the month is shorter), LiteLLM's spelling
    of durations and budget periods; ParamError naming `param` for anything else."""
    from treeserve.errors import ParamError

    match = _DURATION.match(text or "")
    if not match or int(match.group(1)) == 0:
        raise ParamError(param, f"expected a duration such as '30s', '15m', '12h', '30d', '2w' or '1mo', "
                         f"got {text!r}")
    count, unit = int(match.group(1)), match.group(2)
    if unit == "mo":
        within = count <= 12 * (MAX_DURATION.days // 365)
    else:
        try:
            within = dt.timedelta(**{_UNITS[unit]: count}) <= MAX_DURATION
        except OverflowError:
            within = False
    if not within:
        raise ParamError(param, f"at most {MAX_DURATION.days // 365} years, got {text!r}")
    return _add_months(start, count) if unit == "mo" else start + dt.timedelta(**{_UNITS[unit]: count})


def _add_months(start: dt.datetime, months: int) -> dt.datetime:
    year, month = divmod(start.month - 1 + months, 12)
    year += start.year
    last_day = calendar.monthrange(year, month + 1)[1]
    return start.replace(year=year, month=month + 1, day=min(start.day, last_day))


@dataclass(frozen=True)
class KeyRecord:
    """What a request needs to know about its key, read once per request."""
    id: int
    key_name: str
    key_alias: str | None
    user_id: str | None
    models: list | None
    user_models: list | None
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    budgeted: bool = False  # the key, its user or its team has a max_budget
    expires_at: dt.datetime | None = None
    team_id: str | None = None
    team_models: list | None = None
    user_incarnation: str | None = None  # (the user's and team's rows, schema.User.incarnation)
    team_incarnation: str | None = None

    @property
    def expired(self) -> bool:
        return has_expired(self.expires_at)

    @property
    def label(self) -> str:
        return self.key_alias or self.key_name

    def allows(self, model: str) -> bool:
        return self.refuser(model) is None

    def refuser(self, model: str) -> tuple[str, list] | None:
        """Which of the key, its team and its user has a list of models without `model` (LiteLLM checks
        them in this order), and that list; None where all of them allow it."""
        for owner, allowed in (("key", self.models), ("team", self.team_models), ("user", self.user_models)):
            if allowed and model not in allowed:
                return owner, allowed
        return None

    @property
    def holds_nothing(self) -> bool:
        """No budget, no parallel, rate or token limit: admitting a request on this key writes nothing."""
        return not self.budgeted and self.max_parallel_requests is None and self.rpm_limit is None \
            and self.tpm_limit is None

    def nothing_held(self) -> Reservation:
        """The reservation of a request on a key that holds nothing (the master key's too)."""
        return Reservation(self.id, self.user_id, 0.0, False, 0, team_id=self.team_id,
                           user_incarnation=self.user_incarnation, team_incarnation=self.team_incarnation)
