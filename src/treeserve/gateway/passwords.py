"""Users' passwords for the web chat: Argon2id (argon2-cffi), a slow salted hash made for guessable
secrets; keys, which are random, get SHA-256 instead (`keys.py`)."""
from __future__ import annotations

import functools
import logging
import os
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from treeserve.errors import ParamError

MIN_LENGTH = 8
# Test suites only: Argon2id at 1 MiB and one pass (~1 ms a hash instead of ~0.15 s at RFC 9106's
# low-memory parameters, argon2-cffi's default); the sign-in logic is the same, the hashes are weak.
INSECURE_FAST_ENV = "TREESERVE_INSECURE_FAST_PASSWORD_HASHES"


def _make_hasher() -> PasswordHasher:
    if os.environ.get(INSECURE_FAST_ENV) == "1":
        logging.getLogger("treeserve.gateway").warning("%s=1: weak password hashes (for tests only)",
                                                       INSECURE_FAST_ENV)
        return PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
    return PasswordHasher()


_hasher = _make_hasher()


def hash_password(password: str) -> str:
    if not isinstance(password, str) or len(password) < MIN_LENGTH:
        raise ParamError("password", f"at least {MIN_LENGTH} characters")
    return _hasher.hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    """Takes the same time whether or not there is a hash to check (no user is told apart by timing)."""
    try:
        return _hasher.verify(password_hash or _dummy_hash(), password) and bool(password_hash)
    except (VerificationError, InvalidHashError):
        return False


@functools.lru_cache(maxsize=1)
def _dummy_hash() -> str:
    return _hasher.hash(secrets.token_urlsafe(16))


def needs_rehash(password_hash: str) -> bool:
    return _hasher.check_needs_rehash(password_hash)
