"""Field types for the gateway's request bodies and queries: what its database can hold, checked
at the edge, so that a value it cannot store is a 400 naming the field, never a database error."""
from __future__ import annotations

from typing import Annotated

from fastapi import Path
from pydantic import AfterValidator

INT32_MAX = 2**31 - 1  # the limits and counters are INTEGER columns (32 bits in PostgreSQL)
NO_NUL = r"^[^\x00]*$"  # the same rule, for a query parameter's `pattern`
# the ids one admin call names (keys, users, teams, members): each is a parameter of one statement, and
# PostgreSQL takes at most 65,535 (past them psycopg fails before sending, and that read as an outage)
MAX_IDS = 10_000


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("must not contain NUL characters")  # PostgreSQL's text cannot hold one
    return text


Text = Annotated[str, AfterValidator(_no_nul)]


# a row's id in a route's path (files, batches, stored responses): what no row's id can be is a 400
PathId = Annotated[str, Path(max_length=64, pattern=NO_NUL)]
