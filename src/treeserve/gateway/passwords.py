"""Users' passwords for the web chat: Argon2id (argon2-cffi), a slow salted hash made for guessable
secrets; keys, which are random, get SHA-256 instead (`keys.py`)."""
from __future__ import annotations

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from treeserve.errors import ParamError

MIN_LENGTH = 8
_hasher = PasswordHasher()


def hash_password(password: str) -> str:
    if not isinstance(password, str) or len(password) < MIN_LENGTH:
        raise ParamError("password", f"password: at least {MIN_LENGTH} characters")
    return _hasher.hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    if not password_hash:
        return False
    try:
        return _hasher.verify(password_hash, password)
    except (VerificationError, InvalidHashError):
        return False


def needs_rehash(password_hash: str) -> bool:
    return _hasher.check_needs_rehash(password_hash)
