"""Users and their virtual keys in the gateway's database, and who a key is (`authenticate`).

A key named for a user who does not exist yet makes that user (with no budget), as LiteLLM does."""
from __future__ import annotations

import datetime as dt

import contextlib
from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from treeserve.gateway import keys as keylib
from treeserve.gateway.account_fields import key_values, public_key, public_user, user_values
from treeserve.gateway.database import Database, violates_unique
from treeserve.gateway.errors import (AliasReserved, AliasTaken, ChatKeyOwner, KeyNotFound, KeysNotFound, KeyTaken,
                                      TeamBlocked, UserExists, UserNotFound)
from treeserve.gateway.team_fields import teams_of
from treeserve.gateway.team_rules import check_key_team
from treeserve.gateway.keys import MASTER_LABEL, KeyRecord
from treeserve.gateway.schema import ApiKey, ChatSession, Team, TeamMember, User, aware, utcnow

@dataclass(frozen=True)
class Page:
    number: int  # from 1
    size: int


@dataclass(frozen=True)
class Sort:
    by: str  # a name in KEY_SORTS or USER_SORTS
    descending: bool = False


KEY_SORTS = {"created_at": ApiKey.created_at, "spend": ApiKey.spend, "key_alias": ApiKey.key_alias,
             "user_id": ApiKey.user_id, "max_budget": ApiKey.max_budget, "expires": ApiKey.expires_at}
USER_SORTS = {"created_at": User.created_at, "spend": User.spend, "user_id": User.user_id,
              "max_budget": User.max_budget}
CHAT_ALIAS_PREFIX = "chat:"  # the web chat's keys are `chat:<user>`; the admin API gives no key such an alias


class Accounts:
    def __init__(self, db: Database):
        self.db = db

    # ---- users -------------------------------------------------------------------------------
    def create_user(self, user_id: str, password_hash: str | None = None, **fields) -> dict:
        return self.create_user_with_key(user_id, password_hash, None, **fields)[1]

    def create_user_with_key(self, user_id: str, password_hash: str | None, key: dict | None,
                             **fields) -> tuple[str | None, dict]:
        """The user and, when `key` (a key's fields) is given, a key of theirs made in the same
        transaction (LiteLLM's /user/new): (that key's token, shown this once, or None; the user's info)."""
        now = utcnow()
        token = keylib.new_key() if key is not None else None
        key_row = _new_key_values({**key, "user_id": user_id}, now) if key is not None else None
        with _unique_key(key_row and key_row.get("key_alias")), self.db.transaction() as conn:
            values = user_values(fields, now) | {"password_hash": password_hash}
            if not _add_user(self.db, conn, user_id, values, now):
                raise UserExists(user_id)
            if key_row is not None:
                _insert_key(conn, token, key_row, now)
        return token, self.user_info(user_id)

    def user_info(self, user_id: str) -> dict:
        with self.db.session() as conn:
            user = conn.get(User, user_id)
            if user is None:
                raise UserNotFound(user_id)
            rows = conn.scalars(select(ApiKey).where(ApiKey.user_id == user_id).order_by(ApiKey.id)).all()
            teams = teams_of(conn, user_id)
        return {"user_id": user_id, "user_info": public_user(user), "keys": [public_key(k) for k in rows],
                "teams": teams}  # (LiteLLM's: the teams the user is a member of)

    def update_user(self, user_id: str, password_hash: str | None = None, **fields) -> dict:
        """The fields given changed (a budget period given starts now; `spend` set, 0 to start again);
        a new password ends the user's web chat sessions, as `users set-password` does (a password
        reset for a stolen account must sign the thief out)."""
        values = user_values(fields, utcnow(), updating=True)
        if password_hash is not None:
            values["password_hash"] = password_hash
        if values:
            with self.db.transaction() as conn:
                if conn.execute(update(User).where(User.user_id == user_id).values(**values)).rowcount == 0:
                    raise UserNotFound(user_id)
                if password_hash is not None:
                    conn.execute(delete(ChatSession).where(ChatSession.user_id == user_id))
        return self.user_info(user_id)

    def delete_users(self, user_ids: list[str]) -> int:
        """All of them with their keys (LiteLLM's rule) and web chat data, or none (UserNotFound)
        when any does not exist; how many users were deleted (an id named twice is one)."""
        with self.db.transaction() as conn:
            # (keys, then users, each by id: settlement.locked_in_order's LOCK ORDER; a DELETE alone
            # takes its rows in the order it finds them, and deadlocked with a settlement batch)
            _lock(conn, select(ApiKey.id).where(ApiKey.user_id.in_(user_ids)).order_by(ApiKey.id))
            found = set(_lock(conn, select(User.user_id).where(User.user_id.in_(user_ids)).order_by(User.user_id)))
            missing = [u for u in user_ids if u not in found]
            if missing:
                raise UserNotFound(missing[0])
            conn.execute(delete(ApiKey).where(ApiKey.user_id.in_(user_ids)))
            conn.execute(delete(TeamMember).where(TeamMember.user_id.in_(user_ids)))
            deleted = conn.execute(delete(User).where(User.user_id.in_(user_ids))).rowcount
        return deleted

    def list_users(self, user_ids: list[str] | None = None, sort: Sort | None = None,
                   page: Page | None = None) -> tuple[list[dict], int]:
        """(a page of the users, how many there are in all): those of `user_ids` if given; in the
        order they were made unless `sort` says otherwise (LiteLLM's /user/list)."""
        query = select(User)
        if user_ids is not None:
            query = query.where(User.user_id.in_(user_ids))
        with self.db.session() as conn:
            rows, total = _paged(conn, query, USER_SORTS, sort, (User.created_at, User.user_id), page)
        return [public_user(u) for u in rows], total

    def set_password_hash(self, user_id: str, password_hash: str) -> None:
        with self.db.transaction() as conn:
            conn.execute(update(User).where(User.user_id == user_id).values(password_hash=password_hash))

    # ---- keys --------------------------------------------------------------------------------
    def create_key(self, duration: str | None = None, token: str | None = None, **fields) -> tuple[str, dict]:
        """A new key: (the token, shown this once; its stored record). `token`: the admin's choice of
        secret (LiteLLM's `key`, a key brought from another gateway), else a random one."""
        token = token or keylib.new_key()
        now = utcnow()
        values = _new_key_values({**fields, "duration": duration}, now)
        with _unique_key(values.get("key_alias"), "key"), self.db.transaction() as conn:
            _ensure_user(self.db, conn, values.get("user_id"), now)  # (the user's row before the team's: LOCK ORDER)
            check_key_team(conn, values.get("team_id"), values.get("models"))
            _insert_key(conn, token, values, now)
        return token, self.key_info(token)

    def key_info(self, token: str | None = None, key_id: int | None = None) -> dict:
        """`token`: the key or its stored hash; or the key whose id is `key_id`."""
        where = ApiKey.id == key_id if token is None else ApiKey.token_hash == keylib.stored_hash(token)
        with self.db.session() as conn:
            row = conn.scalars(select(ApiKey).where(where)).first()
        if row is None:
            raise KeyNotFound("key")
        return public_key(row)

    def regenerate_key(self, token: str, new_token: str | None = None, **fields) -> tuple[str, dict]:
        """A new secret for the key (LiteLLM's /key/regenerate): `new_token`, or a new random one; the
        old one stops working, and the key keeps its id, limits, spend and history, but for the
        `fields` given (as `update_key`'s), changed in the same transaction."""
        new_token = new_token or keylib.new_key()
        now = utcnow()
        values = _key_changes(fields, now) | {"token_hash": keylib.hash_key(new_token),
                                              "key_name": keylib.display_name(new_token)}
        with _unique_key(values.get("key_alias")), self.db.transaction() as conn:
            _change_key(self.db, conn, token, values, now)
        return new_token, self.key_info(new_token)

    def update_key(self, token: str, **fields) -> dict:
        now = utcnow()
        values = _key_changes(fields, now)
        if not values:  # nothing to change: the key as it is (KeyNotFound if there is none)
            return self.key_info(token)
        with _unique_key(values.get("key_alias")), self.db.transaction() as conn:
            _change_key(self.db, conn, token, values, now)
        return self.key_info(token)

    def delete_keys(self, tokens: list[str], aliases: tuple[str, ...] = ()) -> list[str]:
        """All of them (named by key, hash or, LiteLLM's `key_aliases`, alias), or none (KeysNotFound)
        when any does not exist."""
        hashes = [keylib.stored_hash(t) for t in tokens]
        with self.db.transaction() as conn:
            _lock(conn, select(ApiKey.id).where(ApiKey.token_hash.in_(hashes) | ApiKey.key_alias.in_(aliases))
                  .order_by(ApiKey.id))  # (by id, before the DELETE: settlement.locked_in_order's LOCK ORDER)
            found = set(conn.execute(select(ApiKey.token_hash).where(ApiKey.token_hash.in_(hashes))).scalars())
            named = set(conn.execute(select(ApiKey.key_alias).where(ApiKey.key_alias.in_(aliases))).scalars())
            missing = [t for t, h in zip(tokens, hashes) if h not in found] + [a for a in aliases if a not in named]
            if missing:
                raise KeysNotFound(len(missing), "key_aliases" if not tokens else "keys")
            conn.execute(delete(ApiKey).where(ApiKey.token_hash.in_(hashes) | ApiKey.key_alias.in_(aliases)))
        return [*tokens, *aliases]

    def list_keys(self, user_id: str | None = None) -> list[dict]:
        return self.find_keys(user_id=user_id)[0]

    def find_keys(self, user_id: str | None = None, key_alias: str | None = None, key: str | None = None,
                  sort: Sort | None = None, page: Page | None = None,
                  team_id: str | None = None) -> tuple[list[dict], int]:
        """(a page of the keys, how many match in all), filtered as LiteLLM's /key/list (`key`: the
        key or its hash); in the order they were made unless `sort` says otherwise."""
        query = select(ApiKey)
        if user_id is not None:
            query = query.where(ApiKey.user_id == user_id)
        if key_alias is not None:
            query = query.where(ApiKey.key_alias == key_alias)
        if key is not None:
            query = query.where(ApiKey.token_hash == keylib.stored_hash(key))
        if team_id is not None:
            query = query.where(ApiKey.team_id == team_id)
        with self.db.session() as conn:
            rows, total = _paged(conn, query, KEY_SORTS, sort, (ApiKey.id,), page)
        return [public_key(k) for k in rows], total

    def budgeted_accounts(self) -> tuple[int, int]:
        """How many keys and users have a max_budget."""
        with self.db.session() as conn:
            keys = conn.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.max_budget.is_not(None)))
            users = conn.scalar(select(func.count()).select_from(User).where(User.max_budget.is_not(None)))
        return keys, users

    # ---- who a key is ------------------------------------------------------------------------
    def authenticate(self, token: str, explain: bool = False) -> KeyRecord | None:
        """The key's record, or None for an unknown, expired or blocked key (`explain`: a key of a
        blocked team raises TeamBlocked instead, whose 401 says so, as LiteLLM's does)."""
        return self._key_record(ApiKey.token_hash == keylib.hash_key(token), explain)

    def key_record(self, key_id: int) -> KeyRecord | None:
        """As `authenticate`, for a key the gateway holds on a user's behalf (the web chat's)."""
        return self._key_record(ApiKey.id == key_id)

    def _key_record(self, where, explain: bool = False) -> KeyRecord | None:
        with self.db.session() as conn:
            row = conn.execute(
                select(ApiKey, User.models, User.max_budget, User.incarnation, Team)
                .outerjoin(User, User.user_id == ApiKey.user_id).outerjoin(Team, Team.team_id == ApiKey.team_id)
                .where(where)).first()
        if row is None or row[0].blocked or keylib.has_expired(aware(row[0].expires_at)):  # (an expired key is no key, its team's state aside)
            return None
        key, user_models, user_budget, user_incarnation, team = row
        if key.team_id is not None and (team is None or team.blocked):  # (LiteLLM's: a blocked team's keys stop)
            if explain and team is not None:
                raise TeamBlocked(key.team_id)
            return None
        team_budget = team.max_budget if team is not None else None
        budgeted = key.max_budget is not None or user_budget is not None or team_budget is not None
        record = KeyRecord(key.id, key.key_name, key.key_alias, key.user_id, key.models, user_models,
                           key.rpm_limit, key.tpm_limit, key.max_parallel_requests, budgeted, aware(key.expires_at),
                           key.team_id, team.models if team is not None else None, user_incarnation,
                           team.incarnation if team is not None else None)
        return record


def _paged(conn: Session, query, sorts: dict, sort: Sort | None, default_order: tuple, page: Page | None):
    """(the rows of `page`, how many rows `query` has in all), ordered by `sort` (a name of `sorts`)
    or `default_order`, the default order breaking ties."""
    total = conn.scalar(select(func.count()).select_from(query.subquery()))
    order = default_order
    if sort is not None:
        column = sorts[sort.by]
        order = ((column.desc() if sort.descending else column.asc()), *default_order)
    query = query.order_by(*order)
    if page is not None:
        query = query.offset((page.number - 1) * page.size).limit(page.size)
    return conn.scalars(query).all(), total


def _new_key_values(fields: dict, now: dt.datetime) -> dict:
    """A new key's columns from the fields given (`duration`: its lifetime, from now)."""
    duration = fields.pop("duration", None)
    values = key_values(fields, now)
    values.setdefault("extra", {})
    if duration:
        values["expires_at"] = keylib.after(now, duration, "duration")
    _check_alias(values.get("key_alias"))
    return values


def _insert_key(conn: Session, token: str, values: dict, now: dt.datetime) -> None:
    conn.execute(insert(ApiKey).values(
        token_hash=keylib.hash_key(token), key_name=keylib.display_name(token), spend=0.0, reserved=0.0,
        in_flight=0, blocked=values.pop("blocked", False), created_at=now, **values))


def _key_changes(fields: dict, now: dt.datetime) -> dict:
    """The columns an update of a key changes (`duration`: a new lifetime from now, or none)."""
    values = key_values(fields, now)
    if "duration" in fields:
        duration = fields["duration"]
        values["expires_at"] = keylib.after(now, duration, "duration") if duration else None
    return values


def _change_key(db: Database, conn: Session, token: str, values: dict, now: dt.datetime) -> None:
    """The key named by `token` (the key or its hash) given `values`; KeyNotFound if there is none."""
    where = ApiKey.token_hash == keylib.stored_hash(token)
    key = conn.execute(select(ApiKey.key_alias, ApiKey.user_id, ApiKey.web_chat, ApiKey.team_id, ApiKey.models)
                       .where(where).with_for_update()).first()
    if key is None:
        raise KeyNotFound("key")
    _ensure_user(db, conn, values.get("user_id"), now)  # (the key's row, its user's, then its team's: LOCK ORDER)
    if "team_id" in values or "models" in values:  # (a key moved to a team, or given models: within the team's)
        check_key_team(conn, values.get("team_id", key.team_id), values.get("models", key.models))
    if values.get("key_alias") != key.key_alias:  # (LiteLLM's UI sends a key's alias with every edit)
        _check_alias(values.get("key_alias"))
    if key.web_chat and "user_id" in values and values["user_id"] != key.user_id:
        raise ChatKeyOwner(key.user_id)
    conn.execute(update(ApiKey).where(where).values(**values))


def _ensure_user(db: Database, conn: Session, user_id: str | None, now: dt.datetime) -> None:
    """The user a key is given to, made (with no budget) if there is none yet."""
    if user_id:
        _add_user(db, conn, user_id, {"extra": {}}, now)


def _lock(conn: Session, query) -> list:
    """The rows `query` selects, locked in its order (SELECT ... FOR UPDATE; SQLite locks the whole
    database for a write, and has no FOR UPDATE): the first column of each."""
    return list(conn.scalars(query.with_for_update()))


def _add_user(db: Database, conn: Session, user_id: str, values: dict, now: dt.datetime) -> bool:
    """Whether the user was made; False when one of that id exists. The primary key decides (INSERT
    ... ON CONFLICT DO NOTHING): two writes at once make the user once, and the second one learns it
    (on PostgreSQL it waits for the first to commit), where a read first let both insert on PostgreSQL."""
    statement = db.insert(User).values(user_id=user_id, spend=0.0, reserved=0.0, created_at=now, **values)
    statement = statement.on_conflict_do_nothing(index_elements=["user_id"]).returning(User.user_id)
    return conn.execute(statement).first() is not None


def _check_alias(alias: str | None) -> None:
    """What the admin API may not name a key: the master key's label (metrics and logs name a key by
    its alias), or the web chat's reserved prefix."""
    if alias == MASTER_LABEL:
        raise AliasTaken(alias)
    if alias is not None and alias.startswith(CHAT_ALIAS_PREFIX):
        raise AliasReserved(alias, CHAT_ALIAS_PREFIX)


@contextlib.contextmanager
def _unique_key(alias: str | None, secret_field: str = "new_key"):
    """AliasTaken for a write that another key's alias refused, KeyTaken for one whose secret is
    another key's (a regenerated key's `new_key`): the database's unique indexes decide, so two writes
    at once cannot both take an alias (on PostgreSQL the second waits for the first to commit, then fails)."""
    try:
        yield
    except IntegrityError as error:
        if alias is not None and violates_unique(error, "ix_api_keys_key_alias", "api_keys.key_alias"):
            raise AliasTaken(alias) from None
        if violates_unique(error, "ix_api_keys_token_hash", "api_keys.token_hash"):
            raise KeyTaken(secret_field) from None
        raise
