"""The gateway's database: accounts, keys, reservations, rate windows and spend, through SQLAlchemy.

Everything that must hold across several gateway processes is one conditional statement that the
database applies atomically: a budget reservation (`spend + reserved < max_budget`; the hold is cut
to the request's real cost the moment it is answered), a parallel slot (`in_flight <
max_parallel_requests`), a minute's request count (an upsert that returns the new count). SQLite
runs in WAL mode and takes its write lock at the start of each transaction (`BEGIN IMMEDIATE`), so
concurrent writers queue instead of failing; PostgreSQL locks the row. Calls are blocking: the app
runs them in worker threads."""
from __future__ import annotations

import contextlib
import csv
import datetime as dt
import io
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from treeserve.errors import ParamError
from treeserve.gateway import keys as keylib
from treeserve.gateway.keys import KeyRecord
from treeserve.gateway.database import make_engine
from treeserve.gateway.schema import ApiKey, DailySpend, Holding, Instance, RateWindow, SpendLog, User, utcnow
from treeserve.gateway.settlement import Reservation, Settlement, SettlementWriter, apply_settlements
from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.gateway")
MIGRATIONS = Path(__file__).parent / "migrations"
MIGRATION_LOCK = 0x74726565  # PostgreSQL advisory lock id ("tree") serialising migrations
INSTANCE_TIMEOUT = 60.0  # a process silent this long is dead: its holdings are given back
# A budget counts as spent when less than this fraction of it is left: far above the rounding error
# of a sum of costs (about 1e-16 of it per cost added), far below what any budget means to pay for.
BUDGET_TOLERANCE = 1e-9
KEY_FIELDS = ("key_alias", "user_id", "models", "max_budget", "budget_duration", "rpm_limit", "tpm_limit",
              "max_parallel_requests", "metadata", "blocked")
USER_FIELDS = ("max_budget", "budget_duration", "models", "metadata")


def aware(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite hands datetimes back without their zone; every one stored here is UTC."""
    return value.replace(tzinfo=dt.timezone.utc) if value is not None and value.tzinfo is None else value


class Store:
    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        self.writer = self.engine.execution_options(writing=True)
        self._write_lock = threading.Lock() if self.dialect == "sqlite" else contextlib.nullcontext()
        self.instance_id = uuid.uuid4().hex
        self._writer = SettlementWriter(self)

    def migrate(self) -> None:
        """Brings the schema to the newest revision (Alembic; a no-op when it is there). Gateway
        processes started together migrate one after another: SQLite's write lock is taken at the
        transaction's start, PostgreSQL's by an advisory lock held to its end."""
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with self.writer.begin() as conn:
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
            config.attributes["connection"] = conn
            command.upgrade(config, "head")

    def close(self) -> None:
        self._writer.close()
        self.engine.dispose()

    # ---- users -------------------------------------------------------------------------------
    def session(self) -> Session:
        """For reads."""
        return Session(self.engine, expire_on_commit=False)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Session]:
        """A transaction that writes. On SQLite this process's writers also queue on a lock first:
        SQLite's own busy handler waits by sleeping (up to 100 ms a turn), a lock hands over at once."""
        with self._write_lock, Session(self.writer, expire_on_commit=False) as session, session.begin():
            yield session

    def create_user(self, user_id: str, password_hash: str | None = None, **fields) -> dict:
        now = utcnow()
        with self.transaction() as conn:
            if conn.get(User, user_id) is not None:
                raise APIError(400, f"user_id: user {user_id!r} already exists", param="user_id",
                               code="user_exists")
            values = _user_values(fields, now)
            conn.execute(insert(User).values(user_id=user_id, spend=0.0, reserved=0.0, created_at=now,
                                             password_hash=password_hash, **values))
        return self.user_info(user_id)

    def user_info(self, user_id: str) -> dict:
        with self.session() as conn:
            user = conn.get(User, user_id)
            if user is None:
                raise APIError(404, f"user_id: no user {user_id!r}", param="user_id", code="user_not_found")
            rows = conn.scalars(select(ApiKey).where(ApiKey.user_id == user_id).order_by(ApiKey.id)).all()
        return {"user_id": user_id, "user_info": _public_user(user), "keys": [_public_key(k) for k in rows]}

    def set_password_hash(self, user_id: str, password_hash: str) -> None:
        with self.transaction() as conn:
            conn.execute(update(User).where(User.user_id == user_id).values(password_hash=password_hash))

    # ---- keys --------------------------------------------------------------------------------
    def create_key(self, duration: str | None = None, **fields) -> tuple[str, dict]:
        """A new key: (the token, shown this once; its stored record)."""
        token = keylib.new_key()
        now = utcnow()
        values = _key_values(fields, now)
        values.setdefault("extra", {})
        if duration:
            values["expires_at"] = now + keylib.parse_duration(duration, "duration")
        with self.transaction() as conn:
            if values.get("user_id") and conn.get(User, values["user_id"]) is None:
                conn.execute(insert(User).values(user_id=values["user_id"], spend=0.0, reserved=0.0,
                                                            extra={}, created_at=now))
            conn.execute(insert(ApiKey).values(
                token_hash=keylib.hash_key(token), key_name=keylib.display_name(token), spend=0.0, reserved=0.0,
                in_flight=0, blocked=values.pop("blocked", False), created_at=now, **values))
        return token, self.key_info(token)

    def key_info(self, token: str) -> dict:
        with self.session() as conn:
            row = conn.scalars(select(ApiKey).where(ApiKey.token_hash == _token_hash(token))).first()
        if row is None:
            raise APIError(404, "key: no such key", param="key", code="key_not_found")
        return _public_key(row)

    def update_key(self, token: str, **fields) -> dict:
        values = _key_values(fields, utcnow())
        if "duration" in fields:
            duration = fields.pop("duration")
            values["expires_at"] = utcnow() + keylib.parse_duration(duration, "duration") if duration else None
        if not values:  # nothing to change: the key as it is (404 if there is none)
            return self.key_info(token)
        with self.transaction() as conn:
            if values.get("user_id") and conn.get(User, values["user_id"]) is None:
                conn.execute(insert(User).values(user_id=values["user_id"], spend=0.0, reserved=0.0, extra={},
                                                 created_at=utcnow()))
            result = conn.execute(update(ApiKey).where(ApiKey.token_hash == _token_hash(token)).values(**values))
            if result.rowcount == 0:
                raise APIError(404, "key: no such key", param="key", code="key_not_found")
        return self.key_info(token)

    def delete_keys(self, tokens: list[str]) -> list[str]:
        hashes = [_token_hash(t) for t in tokens]
        with self.transaction() as conn:
            found = set(conn.execute(select(ApiKey.token_hash).where(ApiKey.token_hash.in_(hashes))).scalars())
            missing = [t for t, h in zip(tokens, hashes) if h not in found]
            if missing:
                raise APIError(404, f"keys: {len(missing)} of the keys do not exist; none was deleted",
                               param="keys", code="key_not_found")
            conn.execute(delete(ApiKey).where(ApiKey.token_hash.in_(hashes)))
        return tokens

    def list_keys(self, user_id: str | None = None) -> list[dict]:
        query = select(ApiKey).order_by(ApiKey.id)
        if user_id is not None:
            query = query.where(ApiKey.user_id == user_id)
        with self.session() as conn:
            return [_public_key(k) for k in conn.scalars(query)]

    def budgeted_accounts(self) -> tuple[int, int]:
        """How many keys and users have a max_budget."""
        with self.session() as conn:
            keys = conn.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.max_budget.is_not(None)))
            users = conn.scalar(select(func.count()).select_from(User).where(User.max_budget.is_not(None)))
        return keys, users

    def authenticate(self, token: str) -> KeyRecord | None:
        """The key's record, or None for an unknown, expired or blocked key."""
        return self._key_record(ApiKey.token_hash == keylib.hash_key(token))

    def key_record(self, key_id: int) -> KeyRecord | None:
        """As `authenticate`, for a key the gateway holds on a user's behalf (the web chat's)."""
        return self._key_record(ApiKey.id == key_id)

    def _key_record(self, where) -> KeyRecord | None:
        with self.session() as conn:
            row = conn.execute(
                select(ApiKey, User.models, User.max_budget).outerjoin(User, User.user_id == ApiKey.user_id)
                .where(where)).first()
        if row is None or row[0].blocked:
            return None
        key, user_models, user_budget = row
        record = KeyRecord(key.id, key.key_name, key.key_alias, key.user_id, key.models, user_models,
                           key.rpm_limit, key.tpm_limit, key.max_parallel_requests,
                           key.max_budget is not None or user_budget is not None, aware(key.expires_at))
        return None if record.expired else record

    # ---- admission and settlement ----------------------------------------------------------------
    def admit(self, key: KeyRecord, worst_cost: float) -> Reservation:
        """Takes a parallel slot, counts the request in its minute, and reserves its worst-case cost
        on the key and its user, all or nothing. Refusals are APIErrors (429 limits, 400 budget)."""
        if key.holds_nothing:
            return key.nothing_held()  # no write
        now = utcnow()
        window = int(now.timestamp() // 60)
        retry_after = {"Retry-After": str(max(1, 60 - now.second))}
        parallel = key.max_parallel_requests is not None
        counted = key.rpm_limit is not None or key.tpm_limit is not None
        worst_cost = worst_cost if key.budgeted else 0.0
        with self.transaction() as conn:
            if key.budgeted:
                self._reset_due_budgets(conn, key, now)
            if parallel:
                taken = conn.execute(update(ApiKey).where(ApiKey.id == key.id,
                                                          ApiKey.in_flight < key.max_parallel_requests)
                                     .values(in_flight=ApiKey.in_flight + 1)).rowcount
                if not taken:
                    raise APIError(429, f"max_parallel_requests: this key already has {key.max_parallel_requests} "
                                   "requests in flight", param="max_parallel_requests", code="parallel_limit",
                                   headers={"Retry-After": "1"})
            if counted:
                requests, tokens = self._count_request(conn, key.id, window)
                if key.rpm_limit is not None and requests > key.rpm_limit:
                    raise APIError(429, f"rpm_limit: this key's limit of {key.rpm_limit} requests per minute is "
                                   "reached", param="rpm_limit", code="rate_limit", headers=retry_after)
                if key.tpm_limit is not None and tokens >= key.tpm_limit:
                    raise APIError(429, f"tpm_limit: this key's limit of {key.tpm_limit} tokens per minute is "
                                   "reached", param="tpm_limit", code="rate_limit", headers=retry_after)
            if key.budgeted:
                self._reserve(conn, ApiKey, ApiKey.id == key.id, worst_cost, "key")
                if key.user_id is not None:
                    self._reserve(conn, User, User.user_id == key.user_id, worst_cost, "user")
            holding = None
            if parallel or worst_cost:
                holding = conn.execute(insert(Holding).values(
                    instance_id=self.instance_id, key_id=key.id, user_id=key.user_id if key.budgeted else None,
                    worst_cost=worst_cost, parallel=parallel, created_at=now).returning(Holding.id)).scalar_one()
        return Reservation(key.id, key.user_id, worst_cost, parallel, window, counted, holding)

    def heartbeat(self) -> None:
        """This process is alive (its holdings are its own to settle)."""
        self._upsert_instance(utcnow())

    def sweep(self) -> int:
        """Gives back what dead gateway processes held (silent for INSTANCE_TIMEOUT): their
        reservations on keys and users and their parallel slots. Returns the holdings given back."""
        cutoff = utcnow() - dt.timedelta(seconds=INSTANCE_TIMEOUT)
        with self.transaction() as conn:
            live = select(Instance.instance_id).where(Instance.seen_at >= cutoff)
            dead = conn.scalars(select(Holding).where(Holding.instance_id.not_in(live),
                                                      Holding.instance_id != self.instance_id,
                                                      Holding.created_at < cutoff)).all()
            keys: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
            users: dict[str, float] = defaultdict(float)
            for holding in dead:
                keys[holding.key_id][0] += holding.worst_cost
                keys[holding.key_id][1] += int(holding.parallel)
                if holding.user_id is not None:
                    users[holding.user_id] += holding.worst_cost
            for key_id, (released, slots) in keys.items():
                conn.execute(update(ApiKey).where(ApiKey.id == key_id)
                             .values(reserved=ApiKey.reserved - released, in_flight=ApiKey.in_flight - slots))
            for user_id, released in users.items():
                conn.execute(update(User).where(User.user_id == user_id).values(reserved=User.reserved - released))
            if dead:
                conn.execute(delete(Holding).where(Holding.id.in_([h.id for h in dead])))
                log.warning("gave back %d requests' holdings of gateway processes gone silent", len(dead))
            conn.execute(delete(Instance).where(Instance.seen_at < cutoff))
        return len(dead)

    def _upsert_instance(self, seen_at: dt.datetime) -> None:
        with self.transaction() as conn:
            insert_ = (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(Instance)
            conn.execute(insert_.values(instance_id=self.instance_id, seen_at=seen_at).on_conflict_do_update(
                index_elements=["instance_id"], set_={"seen_at": seen_at}))

    def start(self) -> None:
        """Starts the writer thread now (settlements, heartbeats, sweeps), not at the first settlement."""
        self._writer.ensure_started()

    def prune_rate_windows(self) -> int:
        """Deletes the minutes before the last one (rate limits read only the current minute)."""
        current = int(utcnow().timestamp() // 60)
        with self.transaction() as conn:
            return conn.execute(delete(RateWindow).where(RateWindow.window < current - 1)).rowcount

    def release(self, reservation: Reservation, cost: float) -> None:
        """At the request's answer, at once and in one transaction: gives its parallel slot back and
        cuts what it holds on its key and user from its worst case to `cost`, its real cost (the
        settlement, which may wait for its batch, then moves exactly that from `reserved` to
        `spend`). A client that sends its next request as the last one ends finds its slot free and
        its budget held only for what it spent. The `holdings` row follows, so a sweep after this
        process died gives back what is held now."""
        held = cost if reservation.held else 0.0  # (a key without a budget, or free models: nothing held)
        given_back = reservation.held - held
        if not reservation.parallel and not given_back:
            return
        with self.transaction() as conn:
            values = {"reserved": ApiKey.reserved - given_back} if given_back else {}
            if reservation.parallel:
                values["in_flight"] = ApiKey.in_flight - 1
            conn.execute(update(ApiKey).where(ApiKey.id == reservation.key_id).values(**values))
            if given_back and reservation.user_id is not None:
                conn.execute(update(User).where(User.user_id == reservation.user_id)
                             .values(reserved=User.reserved - given_back))
            if reservation.holding_id is not None:
                conn.execute(update(Holding).where(Holding.id == reservation.holding_id)
                             .values(parallel=False, worst_cost=held))
        reservation.parallel, reservation.held = False, held

    def settle(self, settlement: Settlement) -> None:
        """Turns a reservation into the real cost now (see `settle_later` for the serving path)."""
        with self.transaction() as conn:
            apply_settlements(self, conn, [settlement])

    def settle_later(self, settlement: Settlement) -> None:
        """Queues the settlement for the writer thread, which commits whatever has queued up in one
        transaction: one write per batch instead of one per request. Budgets stay safe meanwhile,
        since a request's cost stays held (its worst case, or its real cost once `release`d) until
        its settlement is committed."""
        self._writer.put(settlement)

    def flush(self, timeout: float = 30.0) -> None:
        """Waits until every queued settlement is committed."""
        self._writer.flush(timeout)

    def _reset_due_budgets(self, conn: Session, key: KeyRecord, now: dt.datetime) -> None:
        targets = [(ApiKey, ApiKey.id == key.id)]
        if key.user_id is not None:
            targets.append((User, User.user_id == key.user_id))
        for table, where in targets:
            row = conn.execute(select(table.budget_duration, table.budget_reset_at).where(where)).first()
            if row is not None and row.budget_reset_at is not None and aware(row.budget_reset_at) <= now:
                if not row.budget_duration:  # (a period cleared without its reset time)
                    conn.execute(update(table).where(where).values(budget_reset_at=None))
                    continue
                period = keylib.parse_duration(row.budget_duration, "budget_duration")
                conn.execute(update(table).where(where, table.budget_reset_at == row.budget_reset_at)
                             .values(spend=0.0, budget_reset_at=now + period))

    def _count_request(self, conn: Session, key_id: int, window: int) -> tuple[int, int]:
        row = self.upsert(conn, RateWindow, dict(key_id=key_id, window=window, requests=1, tokens=0),
                           ["key_id", "window"], ["requests"], returning=True)
        return row.requests, row.tokens

    @staticmethod
    def _reserve(conn: Session, table, where, worst_cost: float, owner: str) -> None:
        """Holds `worst_cost` while anything of the budget is left. "Left" allows for float rounding:
        spend is a sum of costs, each rounded, so 8 requests of max_budget / 8 may sum to 0.19999999
        of 0.2 and let a 9th in; a remainder under BUDGET_TOLERANCE of the budget counts as none."""
        left = table.spend + table.reserved < table.max_budget * (1.0 - BUDGET_TOLERANCE)
        taken = conn.execute(update(table).where(where, table.max_budget.is_(None) | left)
                             .values(reserved=table.reserved + worst_cost)).rowcount
        if not taken:
            row = conn.execute(select(table.spend, table.reserved, table.max_budget).where(where)).first()
            if row is None:  # deleted since this process cached it
                raise APIError(401, f"invalid API key: its {owner} no longer exists", code="invalid_api_key")
            raise APIError(400, f"max_budget: the {owner}'s budget is exceeded: spent {row.spend:.6f} (and "
                           f"{row.reserved:.6f} held by requests in flight or being settled) of max_budget "
                           f"{row.max_budget:.6f}", param="max_budget", code="budget_exceeded")

    def upsert(self, conn: Session, table, values: dict, keys: list[str], add: list[str], returning=False):
        """INSERT, or on a conflict on `keys` add `add`'s values to the row's (both dialects)."""
        insert = (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table)
        statement = insert.values(**values).on_conflict_do_update(
            index_elements=keys, set_={c: getattr(table, c) + getattr(insert.excluded, c) for c in add})
        if returning:
            return conn.execute(statement.returning(table.requests, table.tokens)).first()
        conn.execute(statement)
        return None

    # ---- reading spend -----------------------------------------------------------------------
    def spend_logs(self, key: str | None = None, user_id: str | None = None, start: dt.datetime | None = None,
                   end: dt.datetime | None = None, limit: int = 1000) -> list[dict]:
        """Spend rows, oldest first; `key` is a key or its hash."""
        key_id = None
        if key is not None:
            with self.session() as conn:
                key_id = conn.execute(select(ApiKey.id).where(ApiKey.token_hash == _token_hash(key))).scalar()
            if key_id is None:
                raise APIError(404, "api_key: no such key", param="api_key", code="key_not_found")
        return self.logs(key_id, user_id, start, end, limit)

    def logs(self, key_id: int | None = None, user_id: str | None = None, start: dt.datetime | None = None,
             end: dt.datetime | None = None, limit: int = 1000) -> list[dict]:
        query = select(SpendLog).order_by(SpendLog.started_at, SpendLog.id).limit(limit)
        if key_id is not None:
            query = query.where(SpendLog.key_id == key_id)
        if user_id is not None:
            query = query.where(SpendLog.user_id == user_id)
        if start is not None:
            query = query.where(SpendLog.started_at >= start)
        if end is not None:
            query = query.where(SpendLog.started_at < end)
        with self.session() as conn:
            return [_public_log(r) for r in conn.scalars(query)]

    def daily_spend(self, key_id: int | None = None) -> list[dict]:
        query = select(DailySpend).order_by(DailySpend.day, DailySpend.key_id, DailySpend.model)
        if key_id is not None:
            query = query.where(DailySpend.key_id == key_id)
        with self.session() as conn:
            return [{"day": r.day.isoformat(), "key_id": r.key_id, "model": r.model, "user_id": r.user_id,
                     "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                     "completion_tokens": r.completion_tokens, "cost": r.cost} for r in conn.scalars(query)]

    def total_spend(self) -> float:
        with self.session() as conn:
            return float(conn.execute(select(func.coalesce(func.sum(SpendLog.cost), 0.0))).scalar())


def logs_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    fields = ["request_id", "started_at", "ended_at", "key_id", "user_id", "model", "backend", "route", "stream",
              "status", "prompt_tokens", "completion_tokens", "cost"]
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _token_hash(token_or_hash: str) -> str:
    """Admin routes take a key or its stored hash (as LiteLLM's do)."""
    is_hash = len(token_or_hash) == 64 and all(c in "0123456789abcdef" for c in token_or_hash)
    return token_or_hash if is_hash else keylib.hash_key(token_or_hash)


def _key_values(fields: dict, now: dt.datetime) -> dict:
    unknown = set(fields) - set(KEY_FIELDS) - {"duration"}
    if unknown:
        raise ParamError(sorted(unknown)[0], f"{sorted(unknown)[0]}: not a key field")
    values = {k: v for k, v in fields.items() if k in KEY_FIELDS and k != "metadata"}
    if "metadata" in fields:
        values["extra"] = fields["metadata"] or {}
    _check_limits(values)
    _budget_period(values, now)
    return values


def _budget_period(values: dict, now: dt.datetime) -> None:
    """A budget period set starts now; one cleared stops resetting."""
    if "budget_duration" in values:
        duration = values["budget_duration"]
        values["budget_reset_at"] = now + keylib.parse_duration(duration, "budget_duration") if duration else None


def _user_values(fields: dict, now: dt.datetime) -> dict:
    unknown = set(fields) - set(USER_FIELDS)
    if unknown:
        raise ParamError(sorted(unknown)[0], f"{sorted(unknown)[0]}: not a user field")
    values = {k: v for k, v in fields.items() if k != "metadata"}
    values["extra"] = fields.get("metadata") or {}
    _check_limits(values)
    _budget_period(values, now)
    return values


def _check_limits(values: dict) -> None:
    for name in ("max_budget", "rpm_limit", "tpm_limit", "max_parallel_requests"):
        value = values.get(name)
        if value is not None and value < 0:
            raise ParamError(name, f"{name}: must be at least 0, got {value}")


def _public_key(key: ApiKey) -> dict:
    return {"token": key.token_hash, "key_name": key.key_name, "key_alias": key.key_alias, "user_id": key.user_id,
            "models": key.models or [], "max_budget": key.max_budget, "spend": key.spend, "reserved": key.reserved,
            "budget_duration": key.budget_duration, "budget_reset_at": iso(key.budget_reset_at),
            "rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit,
            "max_parallel_requests": key.max_parallel_requests, "expires": iso(key.expires_at),
            "blocked": key.blocked, "metadata": key.extra or {}, "created_at": iso(key.created_at)}


def _public_user(user: User) -> dict:
    return {"user_id": user.user_id, "max_budget": user.max_budget, "spend": user.spend, "reserved": user.reserved,
            "budget_duration": user.budget_duration, "budget_reset_at": iso(user.budget_reset_at),
            "models": user.models or [], "metadata": user.extra or {}, "created_at": iso(user.created_at)}


def _public_log(log: SpendLog) -> dict:
    return {"request_id": log.request_id, "key_id": log.key_id, "user_id": log.user_id, "model": log.model,
            "backend": log.backend, "route": log.route, "stream": log.stream, "status": log.status,
            "prompt_tokens": log.prompt_tokens, "completion_tokens": log.completion_tokens,
            "total_tokens": log.prompt_tokens + log.completion_tokens, "cost": log.cost,
            "started_at": iso(log.started_at), "ended_at": iso(log.ended_at)}


def iso(value: dt.datetime | None) -> str | None:
    return aware(value).isoformat() if value is not None else None
