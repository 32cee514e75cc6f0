"""Settling requests: what a request cost becomes spend on its key, user and team, tokens in its
minute, a `spend_logs` row and its day's `daily_spend` total. A writer thread commits whatever
has queued up every SETTLEMENT_INTERVAL in one transaction, one statement per key, user, minute
and day touched; the same thread runs the process's chores (pruning old rate windows, sweeping what
dead processes held), handed to it where it is built. Not the heartbeat (gateway/heartbeat.py): a
writer stalled on the database must not make its process look dead."""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from treeserve.gateway.database import Database
from treeserve.gateway.schema import (ApiKey, BatchLine, DailySpend, Holding, RateWindow, SpendLog, Team, User, team_row,
                                      user_row, utcnow)
from treeserve.gateway.usage import Usage, token_details

log = logging.getLogger("treeserve.gateway")
SETTLEMENT_BATCH = 256  # settlements committed in one transaction, at most
# How long the writer gathers settlements before committing them: fewer, larger transactions, and
# a writer thread that seldom competes with the event loop for the GIL.
SETTLEMENT_INTERVAL = 0.05
PRUNE_INTERVAL = 60.0  # seconds between deletions of past minutes' rate windows (and sweeps)
CHORE_TICK = 5.0  # seconds an idle writer waits for a settlement before it looks for chores due
MASTER_KEY_ID = 0  # the master key's rows in daily_spend (its spend logs have no key_id)
Chore = tuple[str, float, Callable[[], object]]  # (name, seconds between runs, the job)


@dataclass
class Reservation:
    key_id: int | None  # None: the master key (no limits, no budget)
    user_id: str | None
    held: float  # reserved on its key and user: its worst case, cut to its real cost when answered
    parallel: bool  # holds a parallel slot (given back when answered)
    window: int
    counted: bool = False  # counted in its minute's rate window (the key has rpm or tpm limits)
    holding_id: int | None = None  # its row in `holdings` (what a dead process's sweep gives back)
    tokens: int = 0  # its worst-case tokens counted in its minute at admission (a tpm_limit's key)
    team_id: str | None = None  # its key's team (held and spent on it as on the key)
    # the user's and team's rows it was admitted on (schema.User.incarnation): one deleted and made
    # again under its id meanwhile is another, which this request's settlement leaves alone
    user_incarnation: str | None = None
    team_incarnation: str | None = None


@dataclass
class Settlement:
    """How one request ended and what it cost: turned into spend, tokens and rows in one batch."""
    reservation: Reservation
    request_id: str
    model: str
    backend: str | None
    route: str
    stream: bool
    status: str
    usage: Usage
    cost: float
    started_at: dt.datetime
    ended_at: dt.datetime = field(default_factory=utcnow)
    # a batch line's request (batch id, line): its answer (HTTP status, body) is written with its spend
    batch_line: tuple[str, int] | None = None
    answer: tuple[int, bytes] | None = None


class SettlementWriter:
    """One thread that commits queued settlements in batches (started on first use) and runs `chores`."""

    def __init__(self, db: Database, chores: Sequence[Chore] = ()):
        self.db, self.chores = db, list(chores)
        self.queue: queue.Queue[Settlement | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.last_run: dict[str, float] = {}
        self.busy_since: float | None = None  # (monotonic) when its database work in hand began

    def busy_for(self) -> float:
        """Seconds its database work in hand (a batch, a chore) has taken so far: 0 while it waits."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def put(self, item: Settlement) -> None:
        self.ensure_started()
        self.queue.put(item)

    def ensure_started(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="gateway-settlements", daemon=True)
                self.thread.start()

    def flush(self, timeout: float) -> None:
        if self.thread is not None:
            done = threading.Event()
            self.queue.put(done)  # type: ignore[arg-type]
            done.wait(timeout)

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(timeout=30)
            self.thread = None

    def _run(self) -> None:
        self._periodic(force=True)
        while True:
            try:
                batch = [self.queue.get(timeout=CHORE_TICK)]
            except queue.Empty:
                self._periodic()
                continue
            deadline = time.monotonic() + SETTLEMENT_INTERVAL
            while len(batch) < SETTLEMENT_BATCH and isinstance(batch[-1], Settlement):
                try:
                    batch.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            items = [b for b in batch if isinstance(b, Settlement)]
            if items:
                self._commit(items)
            self._periodic()
            for marker in batch:
                if isinstance(marker, threading.Event):
                    marker.set()
            if any(b is None for b in batch):
                return

    def _periodic(self, force: bool = False) -> None:
        """Each chore that is due. A failure is logged and tried again next time."""
        now = time.monotonic()
        for name, interval, job in self.chores:
            if force or now - self.last_run.get(name, 0.0) >= interval:
                self.last_run[name] = now
                try:
                    with self._busy():
                        job()
                except Exception:
                    log.exception("the gateway's %s failed", name)

    def _commit(self, items: list[Settlement]) -> None:
        with self._busy():
            try:
                commit_settlements(self.db, items)
            except Exception:  # one bad row must not lose the batch: commit them one by one
                log.exception("committing %d settlements together failed; retrying one by one", len(items))
                for item in items:
                    try:
                        commit_settlements(self.db, [item])
                    except Exception:
                        log.exception("settlement of %s lost", item.request_id)

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None


def commit_settlements(db: Database, items: list[Settlement]) -> None:
    with db.transaction() as conn:
        apply_settlements(db, conn, items)


def apply_settlements(db: Database, conn: Session, items: list[Settlement]) -> None:
    """Spend, tokens in the minute, a log row and the day's total for each request, with one
    statement per key, user, minute and day touched (not one per request). What each request still
    holds (its real cost, when released at its answer; else its worst case and its slot) goes back."""
    keys: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # released, spent, slots
    users: dict[tuple[str, str | None], list[float]] = defaultdict(lambda: [0.0, 0.0])  # by (id, incarnation)
    teams: dict[tuple[str, str | None], list[float]] = defaultdict(lambda: [0.0, 0.0])
    windows: dict[tuple[int, int], int] = defaultdict(int)
    days: dict[tuple, list] = {}
    swept = _swept_holdings(conn, items)
    for item in items:
        reservation, usage = item.reservation, item.usage
        # (a holding a sweep gave back, its owner thought dead: its hold and slot are back already)
        held, parallel = (0.0, False) if reservation.holding_id in swept else (reservation.held, reservation.parallel)
        if reservation.key_id is not None:
            entry = keys[reservation.key_id]
            entry[0] += held
            entry[1] += item.cost
            entry[2] += int(parallel)
        if reservation.user_id is not None:
            user = users[(reservation.user_id, reservation.user_incarnation)]
            user[0] += held
            user[1] += item.cost
        if reservation.team_id is not None:
            team = teams[(reservation.team_id, reservation.team_incarnation)]
            team[0] += held
            team[1] += item.cost
        if reservation.counted and (usage.total_tokens or reservation.tokens):  # (what it used, for its hold)
            windows[(reservation.key_id, reservation.window)] += usage.total_tokens - reservation.tokens
        day = days.setdefault((item.started_at.date(), reservation.key_id or MASTER_KEY_ID, item.model),
                              [reservation.user_id, 0, 0, 0, 0.0])
        day[1] += 1
        day[2] += usage.prompt_tokens
        day[3] += usage.completion_tokens
        day[4] += item.cost
    for key_id, (released, spent, slots) in sorted(keys.items()):  # (in LOCK ORDER: see locked_in_order)
        values = dict(reserved=ApiKey.reserved - released, spend=ApiKey.spend + spent)
        if slots:
            values["in_flight"] = ApiKey.in_flight - slots
        row = conn.execute(update(ApiKey).where(ApiKey.id == key_id).values(**values)
                           .returning(ApiKey.spend, ApiKey.soft_budget, ApiKey.key_alias, ApiKey.key_name)).first()
        _warn_soft_budget(row, spent)
    for (user_id, incarnation), (released, spent) in locked_in_order(users):
        conn.execute(update(User).where(user_row(user_id, incarnation))
                     .values(reserved=User.reserved - released, spend=User.spend + spent))
    for (team_id, incarnation), (released, spent) in locked_in_order(teams):
        conn.execute(update(Team).where(team_row(team_id, incarnation))
                     .values(reserved=Team.reserved - released, spend=Team.spend + spent))
    for (key_id, window), tokens in sorted(windows.items()):
        conn.execute(update(RateWindow).where(RateWindow.key_id == key_id, RateWindow.window == window)
                     .values(tokens=RateWindow.tokens + tokens))
    conn.execute(insert(SpendLog.__table__), [_log_row(item) for item in items])
    held = [item.reservation.holding_id for item in items if item.reservation.holding_id is not None]
    if held:
        conn.execute(delete(Holding).where(Holding.id.in_(held)))
    # (batch lines by (batch, line), as `take_up` and `claim` take them: in the order their requests ended, two
    # lines answered in one batch deadlocked with a batch's running lines set pending again)
    for item in sorted((i for i in items if i.batch_line is not None and i.answer is not None),
                       key=lambda i: i.batch_line):
        _answer_line(conn, item)
    for (day, key_id, model), (user_id, requests, prompt, completion, cost) in sorted(days.items()):
        db.upsert(conn, DailySpend, dict(day=day, key_id=key_id, model=model, user_id=user_id, requests=requests,
                                         prompt_tokens=prompt, completion_tokens=completion, cost=cost),
                  ["day", "key_id", "model"], ["requests", "prompt_tokens", "completion_tokens", "cost"])


def _swept_holdings(conn: Session, items: list[Settlement]) -> set[int]:
    """The items' holdings that are gone: given back by a sweep (instances.py) while their process,
    silent for a while but alive, went on. Read with the keys' rows held, then their own, each by id
    (LOCK ORDER): no sweep can give one back between this read and the writes that follow. Its own
    rows too: a deleted key's holding has no key row to hold, and read unheld while a sweep gave it
    back, its user's and team's hold went back twice."""
    held = {item.reservation.holding_id for item in items if item.reservation.holding_id is not None}
    if not held:
        return set()
    lock_keys(conn, {item.reservation.key_id for item in items if item.reservation.key_id is not None})
    return held - set(conn.scalars(select(Holding.id).where(Holding.id.in_(sorted(held))).order_by(Holding.id)
                                   .with_for_update()))


def lock_keys(conn: Session, key_ids) -> None:
    """The keys' rows held to the transaction's end, by id (SQLite's writer holds the whole database
    already): the first rows of the LOCK ORDER. FOR NO KEY UPDATE, the lock the UPDATE of a key takes:
    every other writer of the key waits, and a row that names it (a stored response, a file, a batch)
    does not (FOR UPDATE also held off their foreign key checks)."""
    if key_ids:
        conn.execute(select(ApiKey.id).where(ApiKey.id.in_(sorted(key_ids))).order_by(ApiKey.id)
                     .with_for_update(key_share=True)).all()


def locked_in_order(rows: dict[tuple[str, str | None], object]) -> list:
    """Users' or teams' entries by (id, incarnation), sorted by id: the order their rows are locked in.

    LOCK ORDER, the one every transaction that writes several of these rows follows (admission,
    release, settlement, a sweep, /team/delete): keys, then holdings, then users, then teams, then rate
    windows (by key and minute), batch lines (by batch and line) and daily totals, each by id. A request's `holdings` row is written (released, settled,
    swept) only with its key's row held first: whoever holds the key reads the holding as it is
    (admission inserts it last: a row not there yet is nobody's to wait on). Two settlement
    batches of two gateway processes that wrote the same keys or users in different orders
    deadlocked on PostgreSQL (one aborted, its batch retried row by row)."""
    return sorted(rows.items(), key=lambda entry: (entry[0][0], entry[0][1] or ""))


def _warn_soft_budget(row, spent: float) -> None:
    """LiteLLM's soft budget: the settlement that takes a key's spend past it is logged (a warning,
    once a budget period); nothing is refused."""
    if row is not None and row.soft_budget is not None and row.spend - spent < row.soft_budget <= row.spend:
        log.warning("key %s crossed its soft budget: spend %.6f of soft_budget %.6f", row.key_alias or row.key_name,
                    row.spend, row.soft_budget)


def _answer_line(conn: Session, item: Settlement) -> None:
    """A batch line's answer, in its spend row's transaction: billed and answered together, or neither
    (a line left running is run again). Only a running line takes it: a late answer never overwrites."""
    batch_id, line = item.batch_line
    status, body = item.answer
    try:
        response = json.loads(body)
    except ValueError:
        response = {"error": {"message": body.decode("utf-8", "replace")[:2000]}}
    cached, reasoning = token_details(response)  # (its billed tokens, with what its answer says of them)
    conn.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line == line,
                                         BatchLine.status == "running")
                 .values(status="done", status_code=status, response=response, request_id=item.request_id,
                         input_tokens=item.usage.prompt_tokens, output_tokens=item.usage.completion_tokens,
                         cached_tokens=cached, reasoning_tokens=reasoning))


def _log_row(item: Settlement) -> dict:
    reservation, usage = item.reservation, item.usage
    return dict(request_id=item.request_id, key_id=reservation.key_id, user_id=reservation.user_id,
                user_incarnation=reservation.user_incarnation, model=item.model, backend=item.backend,
                route=item.route, stream=item.stream, status=item.status,
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, cost=item.cost,
                started_at=item.started_at, ended_at=item.ended_at)
