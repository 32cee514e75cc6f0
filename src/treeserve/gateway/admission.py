"""Admitting a request on a key: a parallel slot, its minute's request count and its worst-case cost
reserved on its key and user, all in one transaction, all or nothing; given back at its answer.

Each hold is one conditional statement the database applies atomically, so every gateway process
sharing the database enforces the same limits: a budget reservation (`spend + reserved <
max_budget`; the hold is cut to the request's real cost the moment it is answered), a parallel slot
(`in_flight < max_parallel_requests`), a minute's request count (an upsert that returns the new
count) and, on a key with a `tpm_limit`, its worst-case tokens counted in the minute at once (its
answer replaces them with what it used), so requests admitted together see each other: OpenAI
counts `max_tokens` and an estimate of the prompt against its token limits as a request arrives. A refusal is a domain error (gateway/errors.py): LimitExceeded, BudgetExceeded, AccountGone."""
from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from treeserve.gateway.database import Database
from treeserve.gateway.errors import AccountGone, BudgetExceeded, ParallelLimitExceeded, RateLimitExceeded
from treeserve.gateway.keys import KeyRecord, after
from treeserve.gateway.schema import ApiKey, Holding, RateWindow, Team, User, aware, team_row, user_row, utcnow
from treeserve.gateway.settlement import Reservation

log = logging.getLogger("treeserve.gateway")
# A budget counts as spent when less than this fraction of it is left: far above the rounding error
# of a sum of costs (about 1e-16 of it per cost added), far below what any budget means to pay for.
BUDGET_TOLERANCE = 1e-9


class Admission:
    def __init__(self, db: Database, instance_id: str):
        """`instance_id`: this process's, written on each holding (what a sweep gives back if it dies)."""
        self.db, self.instance_id = db, instance_id

    def admit(self, key: KeyRecord, worst_cost: float, worst_tokens: int = 0) -> Reservation:
        """Takes a parallel slot, counts the request (and, under a tpm_limit, its `worst_tokens`) in
        its minute, and reserves its worst-case cost on the key, its user and its team, all or nothing
        (refused: LimitExceeded, BudgetExceeded)."""
        if key.holds_nothing:
            return key.nothing_held()  # no write
        now = utcnow()
        window = int(now.timestamp() // 60)
        parallel = key.max_parallel_requests is not None
        counted = key.rpm_limit is not None or key.tpm_limit is not None
        worst_cost = worst_cost if key.budgeted else 0.0
        tokens = worst_tokens if key.tpm_limit is not None else 0
        with self.db.transaction() as conn:
            if key.budgeted:
                _reset_due_budgets(conn, key, now)
            if parallel:
                _take_slot(conn, key)
            if key.budgeted:
                _reserve_budgets(conn, key, worst_cost)
            if counted:  # (after its key's row: settlement.locked_in_order's LOCK ORDER, keys before minutes)
                self._count_request(conn, key, window, tokens, retry_after=max(1, 60 - now.second))
            holding = self._hold(conn, key, worst_cost, parallel, now) if parallel or worst_cost else None
        return Reservation(key.id, key.user_id, worst_cost, parallel, window, counted, holding, tokens, key.team_id,
                           key.user_incarnation, key.team_incarnation)

    def release(self, reservation: Reservation, cost: float, tokens: int = 0) -> None:
        """At the request's answer, at once and in one transaction: gives its parallel slot back,
        cuts what it holds on its key and user from its worst case to `cost`, its real cost (the
        settlement, which may wait for its batch, then moves exactly that from `reserved` to
        `spend`), and puts `tokens`, those it used, in place of its worst-case tokens in its minute.
        A client that sends its next request as the last one ends finds its slot free, its budget
        held only for what it spent and its minute's tokens only what it used (a search's worst case,
        327,680 tokens by default, left until its settlement, refused a next search sent at once on a
        key with a tpm_limit of 100,000). The `holdings` row follows, so a sweep after this process
        died gives back what is held now."""
        held = cost if reservation.held else 0.0  # (a key without a budget, or free models: nothing held)
        given_back = reservation.held - held
        recounted = tokens - reservation.tokens if reservation.tokens else 0  # (only a tpm_limit's key holds tokens)
        if not reservation.parallel and not given_back and not recounted and reservation.holding_id is None:
            return  # (nothing to give back, and no hold to mark answered)
        try:
            with self.db.transaction() as conn:
                _give_back(conn, reservation, given_back, held)
                if recounted:  # (the minute's row last: settlement.locked_in_order's LOCK ORDER)
                    conn.execute(update(RateWindow).where(RateWindow.key_id == reservation.key_id,
                                                          RateWindow.window == reservation.window)
                                 .values(tokens=RateWindow.tokens + recounted))
            if recounted:  # (committed: its settlement then counts nothing more, what it used is in)
                reservation.tokens = tokens
        except _Swept:  # (this process was silent long enough to be thought dead: a sweep gave it all back)
            log.warning("a request's hold was given back by a sweep before its answer (this process's heartbeats "
                        "stopped for a while): nothing more to give back")
        reservation.parallel, reservation.held = False, held

    def prune_rate_windows(self) -> int:
        """Deletes the minutes before the last one (rate limits read only the current minute)."""
        past = RateWindow.window < int(utcnow().timestamp() // 60) - 1
        with self.db.transaction() as conn:
            # (locked by key and minute first: settlement.locked_in_order's LOCK ORDER; a DELETE alone takes
            # them in the order it finds them, and deadlocked with a settlement batch writing two of them)
            conn.execute(select(RateWindow.key_id).where(past).order_by(RateWindow.key_id, RateWindow.window)
                         .with_for_update()).all()
            return conn.execute(delete(RateWindow).where(past)).rowcount

    def _count_request(self, conn: Session, key: KeyRecord, window: int, tokens: int, retry_after: int) -> None:
        """Counts the request and its worst-case `tokens` in its minute; refused when the minute's
        requests are over the limit, or its tokens (those of the requests admitted before this one:
        used, or held while they run) already at it."""
        row = self.db.upsert(conn, RateWindow, dict(key_id=key.id, window=window, requests=1, tokens=tokens),
                             ["key_id", "window"], ["requests", "tokens"],
                             returning=(RateWindow.requests, RateWindow.tokens))
        if key.rpm_limit is not None and row.requests > key.rpm_limit:
            raise RateLimitExceeded("rpm_limit", key.rpm_limit, "requests", retry_after)
        if key.tpm_limit is not None and row.tokens - tokens >= key.tpm_limit:
            raise RateLimitExceeded("tpm_limit", key.tpm_limit, "tokens", retry_after)

    def _hold(self, conn: Session, key: KeyRecord, worst_cost: float, parallel: bool, now: dt.datetime) -> int:
        """The request's `holdings` row: what a sweep gives back if this process dies before settling it."""
        return conn.execute(insert(Holding).values(
            instance_id=self.instance_id, key_id=key.id, user_id=key.user_id if key.budgeted else None,
            team_id=key.team_id if key.budgeted else None, user_incarnation=key.user_incarnation,
            team_incarnation=key.team_incarnation, worst_cost=worst_cost, parallel=parallel, created_at=now).returning(Holding.id)).scalar_one()


class _Swept(Exception):
    """A request's holding is gone: a sweep gave it back (instances.py), its process thought dead."""


def _give_back(conn: Session, reservation: Reservation, given_back: float, held: float) -> None:
    """`Admission.release`'s writes: the key's row first, then its holding, its user's, its team's
    (settlement.locked_in_order's LOCK ORDER, a sweep's). A holding gone means a sweep has given all of
    it back already: _Swept, and the transaction rolls back (given back twice, the key's `reserved` and
    `in_flight` went below 0). Its holding written after its user's, a release deadlocked with a sweep
    where no key row orders them (the key deleted): each held the row the other wrote next."""
    values = {"reserved": ApiKey.reserved - given_back} if given_back else {}
    if reservation.parallel:
        values["in_flight"] = ApiKey.in_flight - 1
    if values:  # (nothing of it to give back when its real cost is its worst case, and no slot)
        conn.execute(update(ApiKey).where(ApiKey.id == reservation.key_id).values(**values))
    if reservation.holding_id is not None:  # (with nothing to give back, its row alone: no amount changes)
        if not conn.execute(update(Holding).where(Holding.id == reservation.holding_id)
                            .values(parallel=False, worst_cost=held, answered=True)).rowcount:
            raise _Swept()
    if given_back and reservation.user_id is not None:
        conn.execute(update(User).where(user_row(reservation.user_id, reservation.user_incarnation))
                     .values(reserved=User.reserved - given_back))
    if given_back and reservation.team_id is not None:
        conn.execute(update(Team).where(team_row(reservation.team_id, reservation.team_incarnation))
                     .values(reserved=Team.reserved - given_back))


def _take_slot(conn: Session, key: KeyRecord) -> None:
    taken = conn.execute(update(ApiKey).where(ApiKey.id == key.id, ApiKey.in_flight < key.max_parallel_requests)
                         .values(in_flight=ApiKey.in_flight + 1)).rowcount
    if not taken:
        raise ParallelLimitExceeded(key.max_parallel_requests)


def _reserve_budgets(conn: Session, key: KeyRecord, worst_cost: float) -> None:
    _reserve(conn, ApiKey, ApiKey.id == key.id, worst_cost, "key", Holding.key_id == key.id)
    if key.user_id is not None:  # (the user the key was read with: one made again since is another)
        _reserve(conn, User, user_row(key.user_id, key.user_incarnation), worst_cost, "user",
                 (Holding.user_id == key.user_id) & (Holding.user_incarnation == key.user_incarnation))
    if key.team_id is not None:  # (its team's budget caps all its keys' spend together)
        _reserve(conn, Team, team_row(key.team_id, key.team_incarnation), worst_cost, "team",
                 (Holding.team_id == key.team_id) & (Holding.team_incarnation == key.team_incarnation))


def _reserve(conn: Session, table, where, worst_cost: float, owner: str, held_by) -> None:
    """Holds `worst_cost` while anything of the budget is left. "Left" allows for float rounding:
    spend is a sum of costs, each rounded, so 8 requests of max_budget / 8 may sum to 0.19999999
    of 0.2 and let a 9th in; a remainder under BUDGET_TOLERANCE of the budget counts as none."""
    left = table.spend + table.reserved < table.max_budget * (1.0 - BUDGET_TOLERANCE)
    taken = conn.execute(update(table).where(where, table.max_budget.is_(None) | left)
                         .values(reserved=table.reserved + worst_cost)).rowcount
    if not taken:
        # spent: what has been spent (answered requests' costs, their settlements to come, among it)
        # reached the budget; else requests in flight hold the rest (their worst cases, which come
        # back). One statement, so that a settlement committing meanwhile (it moves an answered
        # cost from held to spent) is seen on both sides or neither (PostgreSQL's read committed)
        answered = (select(func.coalesce(func.sum(Holding.worst_cost), 0.0)).where(held_by, Holding.answered)
                    .scalar_subquery())
        row = conn.execute(select(table.spend, table.reserved, table.max_budget, table.budget_reset_at,
                                  answered.label("answered")).where(where)).first()
        if row is None:  # deleted since this process cached it
            raise AccountGone(owner)
        raise BudgetExceeded(owner, row.spend, row.reserved, row.max_budget,
                             spent=row.spend + row.answered >= row.max_budget * (1.0 - BUDGET_TOLERANCE),
                             resets_at=aware(row.budget_reset_at))


def _reset_due_budgets(conn: Session, key: KeyRecord, now: dt.datetime) -> None:
    """Budgets of the key, its user and its team whose period has ended start again from nothing spent.
    The rows before one written (the key's before its user's, both before its team's) are held first,
    settlement.locked_in_order's LOCK ORDER: a user's reset written before its key's row deadlocked
    with a settlement of the key on PostgreSQL, a team's before its user's with one of another key."""
    targets = [(ApiKey, ApiKey.id == key.id)]
    if key.user_id is not None:
        targets.append((User, user_row(key.user_id, key.user_incarnation)))
    if key.team_id is not None:
        targets.append((Team, team_row(key.team_id, key.team_incarnation)))
    held = 0  # (how many of `targets` this transaction holds)
    for index, (table, where) in enumerate(targets):
        row = conn.execute(select(table.budget_duration, table.budget_reset_at).where(where)).first()
        if row is None or row.budget_reset_at is None or aware(row.budget_reset_at) > now:
            continue
        for before, before_where in targets[held:index]:
            conn.execute(select(before.budget_reset_at).where(before_where).with_for_update()).first()
        held = index + 1
        if not row.budget_duration:  # (a period cleared without its reset time)
            conn.execute(update(table).where(where).values(budget_reset_at=None))
            continue
        conn.execute(update(table).where(where, table.budget_reset_at == row.budget_reset_at)
                     .values(spend=0.0, budget_reset_at=after(now, row.budget_duration, "budget_duration")))
