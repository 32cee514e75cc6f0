"""What requests cost, written and read: settlements (at once, or batched by the writer thread of
gateway/settlement.py), spend logs, daily totals and their CSV export."""
from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Sequence

from sqlalchemy import func, select

from treeserve.gateway.database import Database
from treeserve.gateway.errors import KeyNotFound
from treeserve.gateway.keys import stored_hash
from treeserve.gateway.schema import ApiKey, DailySpend, SpendLog, User, aware, iso, money
from treeserve.gateway.settlement import Chore, Settlement, SettlementWriter, commit_settlements

LOG_FIELDS = ["request_id", "started_at", "ended_at", "key_id", "api_key", "user_id", "model", "backend", "route", "stream",
              "status", "prompt_tokens", "completion_tokens", "cost", "user_deleted"]


class Ledger:
    def __init__(self, db: Database, chores: Sequence[Chore] = ()):
        """`chores`: what the writer thread also runs, each on its own interval (pruning, sweeps)."""
        self.db = db
        self._writer = SettlementWriter(db, chores)

    # ---- writing -----------------------------------------------------------------------------
    def settle(self, settlement: Settlement) -> None:
        """Turns a reservation into the real cost now (see `settle_later` for the serving path)."""
        commit_settlements(self.db, [settlement])

    def settle_later(self, settlement: Settlement) -> None:
        """Queues the settlement for the writer thread, which commits whatever has queued up in one
        transaction: one write per batch instead of one per request. Budgets stay safe meanwhile,
        since a request's cost stays held (its worst case, or its real cost once released) until
        its settlement is committed."""
        self._writer.put(settlement)

    def flush(self, timeout: float = 30.0) -> None:
        """Waits until every queued settlement is committed."""
        self._writer.flush(timeout)

    def start(self) -> None:
        """Starts the writer thread now (settlements and chores), not at the first settlement."""
        self._writer.ensure_started()

    def close(self) -> None:
        """Commits what is queued and stops the writer thread."""
        self._writer.close()

    def writer_busy_for(self) -> float:
        """Seconds the writer thread's database work in hand has taken so far (0 while it waits)."""
        return self._writer.busy_for()

    # ---- reading -----------------------------------------------------------------------------
    def spend_logs(self, key: str | None = None, user_id: str | None = None, start: dt.datetime | None = None,
                   end: dt.datetime | None = None, limit: int = 1000, request_id: str | None = None,
                   order: str = "asc") -> list[dict]:
        """Spend rows, oldest first (`order` "desc": newest first), each with its key's hash (`api_key`,
        None once the key is deleted) and `user_deleted` (`of_deleted_user`); `key` is a key or its hash
        (KeyNotFound when there is none). A user's rows are all of its id's, a deleted account's among
        them (LiteLLM's logs keep user ids as strings): `user_deleted` tells them apart."""
        key_id = None
        if key is not None:
            with self.db.session() as conn:
                key_id = conn.execute(select(ApiKey.id).where(ApiKey.token_hash == stored_hash(key))).scalar()
            if key_id is None:
                raise KeyNotFound("api_key")
        return self.logs(key_id, user_id, start, end, limit, request_id, order)

    def logs(self, key_id: int | None = None, user_id: str | None = None, start: dt.datetime | None = None,
             end: dt.datetime | None = None, limit: int = 1000, request_id: str | None = None,
             order: str = "asc") -> list[dict]:
        ordering = (SpendLog.started_at, SpendLog.id) if order == "asc" else (SpendLog.started_at.desc(),
                                                                               SpendLog.id.desc())
        query = (select(SpendLog, ApiKey.token_hash, User).outerjoin(ApiKey, ApiKey.id == SpendLog.key_id)
                 .outerjoin(User, User.user_id == SpendLog.user_id).order_by(*ordering).limit(limit))
        for column, value in ((SpendLog.key_id, key_id), (SpendLog.user_id, user_id),
                              (SpendLog.request_id, request_id)):
            if value is not None:
                query = query.where(column == value)
        if start is not None:
            query = query.where(SpendLog.started_at >= start)
        if end is not None:
            query = query.where(SpendLog.started_at < end)
        with self.db.session() as conn:
            return [_public_log(log) | {"api_key": token_hash, "user_deleted": of_deleted_user(log, user)}
                    for log, token_hash, user in conn.execute(query)]

    def daily_spend(self, key_id: int | None = None) -> list[dict]:
        query = (select(DailySpend, ApiKey.token_hash).outerjoin(ApiKey, ApiKey.id == DailySpend.key_id)
                 .order_by(DailySpend.day, DailySpend.key_id, DailySpend.model))
        if key_id is not None:
            query = query.where(DailySpend.key_id == key_id)
        with self.db.session() as conn:
            return [{"day": r.day.isoformat(), "key_id": r.key_id, "api_key": token_hash, "model": r.model,
                     "user_id": r.user_id, "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                     "completion_tokens": r.completion_tokens, "cost": money(r.cost)}
                    for r, token_hash in conn.execute(query)]

    def total_spend(self) -> float:
        with self.db.session() as conn:
            return money(float(conn.execute(select(func.coalesce(func.sum(SpendLog.cost), 0.0))).scalar()))


def of_deleted_user(log: SpendLog, user: User | None) -> bool | None:
    """Whether a spend row's user is gone: deleted, or deleted and made again under its id (`user`: the
    user of that id now, if any). Exact by the user row's incarnation the request was admitted on; a
    row without one (written before migration 0016, or by a gateway from before it during an upgrade)
    by time: it is the current account's when it started at or after the account was made. None: a
    request of no user. The web chat's usage counts the same rows by the same rule (`of_user_now`)."""
    if log.user_id is None:
        return None
    if user is None:
        return True
    if log.user_incarnation is not None:
        return log.user_incarnation != user.incarnation
    return aware(log.started_at) < aware(user.created_at)


def of_user_now(user: User):
    """The condition on spend rows of `user.user_id` that are its current account's (`of_deleted_user`'s
    rule, in SQL)."""
    by_time = SpendLog.user_incarnation.is_(None) & (SpendLog.started_at >= user.created_at)
    return (SpendLog.user_id == user.user_id) & ((SpendLog.user_incarnation == user.incarnation) | by_time)


def logs_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=LOG_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _public_log(log: SpendLog) -> dict:
    return {"request_id": log.request_id, "key_id": log.key_id, "user_id": log.user_id, "model": log.model,
            "backend": log.backend, "route": log.route, "stream": log.stream, "status": log.status,
            "prompt_tokens": log.prompt_tokens, "completion_tokens": log.completion_tokens,
            "total_tokens": log.prompt_tokens + log.completion_tokens, "cost": log.cost,
            "started_at": iso(log.started_at), "ended_at": iso(log.ended_at),
            # LiteLLM's names for the same, which its clients and admin UI read
            "spend": log.cost, "user": log.user_id, "startTime": iso(log.started_at), "endTime": iso(log.ended_at)}
