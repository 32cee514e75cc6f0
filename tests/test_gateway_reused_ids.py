"""A user or team deleted and made again under the same id while a request admitted on the old one
is in flight: the request's settlement, its release at its answer and a dead process's sweep leave the
new row alone (its `reserved` never below 0, none of the old one's spend on it); migration 0015 gives
the rows already there their incarnations. On SQLite and PostgreSQL."""
from __future__ import annotations

import datetime as dt

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select, text, update

from conftest import migrations_head
from test_gateway_store import _store_at_revision, store  # noqa: F401 (a fixture: the store on each database)
from treeserve.gateway.ledger import logs_csv
from treeserve.gateway.schema import Base, Holding, Instance, Team, User, utcnow
from treeserve.gateway.settlement import Settlement
from treeserve.gateway.store import Store
from treeserve.gateway.usage import Usage


def _make(store, kind: str, name: str) -> None:
    if kind == "team":
        store.teams.create_team(name, [], max_budget=1.0)
    else:
        store.accounts.create_user(name, max_budget=1.0)


def _delete(store, kind: str, name: str) -> None:
    if kind == "team":
        store.teams.delete_teams([name])
    else:
        store.accounts.delete_users([name])


def _row(store, kind: str, name: str):
    with store.db.session() as s:
        return s.get(Team if kind == "team" else User, name)


def _settle(store, reservation, cost: float, started_at: dt.datetime | None = None) -> None:
    store.ledger.settle(Settlement(reservation, f"r{id(reservation)}", "m", None, "chat", False, "success",
                                   Usage(1, 1), cost, started_at or utcnow()))


@pytest.mark.parametrize("kind", ["team", "user"])
def test_a_request_of_a_deleted_owner_settles_nothing_on_one_made_again_under_its_id(store, kind):
    """Three requests on a key of `x` (a team's key, or a user's): one settled, one answered then
    settled, one whose process dies; `x` is deleted (its keys with it) and made again before any of it
    settles. The new `x` holds nothing and spent nothing, and its whole budget is there to admit."""
    _make(store, kind, "x")
    owner = {"team_id": "x"} if kind == "team" else {"user_id": "x"}
    key = store.accounts.authenticate(store.accounts.create_key(**owner)[0])
    store.instances.heartbeat()
    settled, released, orphaned = (store.admission.admit(key, 0.25) for _ in range(3))
    assert _row(store, kind, "x").reserved == pytest.approx(0.75)
    _delete(store, kind, "x")
    _make(store, kind, "x")
    store.admission.release(released, 0.1)
    _settle(store, released, 0.1)
    _settle(store, settled, 0.2)
    long_ago = utcnow() - dt.timedelta(minutes=5)
    with store.db.transaction() as s:  # (this process is dead: `orphaned` is a sweep's to give back)
        s.execute(update(Instance).values(seen_at=long_ago))
        s.execute(update(Holding).values(created_at=long_ago))
    other = Store(store.db.url)
    try:
        assert other.instances.sweep() == 1
    finally:
        other.close()
    new = _row(store, kind, "x")
    assert (new.reserved, new.spend) == (0.0, 0.0)
    fresh = store.accounts.authenticate(store.accounts.create_key(**owner)[0])
    store.admission.admit(fresh, 1.0)  # (all of its budget: nothing of the old one's held on it)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_incarnations_migration_upgrades_a_database_at_0014(backend, request, tmp_path):
    """Migration 0015 on a database at 0014: each user and team gets an incarnation of its own, a
    holding in flight the one of the rows it reserved on (a sweep then gives its hold back), and the
    schema is exactly the ORM's; downgrading keeps the rows."""
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else \
        request.getfixturevalue("postgres").new_database()
    old = _store_at_revision(url, "0014")
    with old.db.transaction() as conn:
        for user in ("ann", "bob"):
            conn.execute(text("INSERT INTO users (user_id, spend, reserved, metadata, created_at) "
                              "VALUES (:u, 0, 0.5, '{}', CURRENT_TIMESTAMP)"), {"u": user})
        conn.execute(text("INSERT INTO teams (team_id, spend, reserved, blocked, metadata, created_at) "
                          "VALUES ('t', 0, 0.5, :no, '{}', CURRENT_TIMESTAMP)"), {"no": False})
        conn.execute(text("INSERT INTO holdings (instance_id, key_id, user_id, team_id, worst_cost, parallel, "
                          "answered, created_at) VALUES ('gone', 1, 'ann', 't', 0.5, :no, :no, :at)"),
                     {"no": False, "at": utcnow() - dt.timedelta(minutes=5)})
    old.close()
    store = Store(url)
    try:
        store.migrate()
        assert store.db.revision() == migrations_head()
        with store.db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        with store.db.session() as s:
            users = {u.user_id: u.incarnation for u in s.scalars(select(User))}
            team = s.get(Team, "t")
            holding = s.scalars(select(Holding)).one()
        assert len(set(users.values())) == 2 and all(len(i) == 32 for i in users.values())
        assert (holding.user_incarnation, holding.team_incarnation) == (users["ann"], team.incarnation)
        assert store.instances.sweep() == 1
        assert (_row(store, "user", "ann").reserved, _row(store, "team", "t").reserved) == (0.0, 0.0)
        with store.db.transaction() as conn:  # a gateway from before 0015 still running: its rows have none
            conn.execute(text("INSERT INTO users (user_id, spend, reserved, metadata, created_at) "
                              "VALUES ('cy', 0, 0.5, '{}', CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO holdings (instance_id, key_id, user_id, worst_cost, parallel, answered, "
                              "created_at) VALUES ('gone', 1, 'cy', 0.5, :no, :no, :at)"),
                         {"no": False, "at": utcnow() - dt.timedelta(minutes=5)})
        cy = _row(store, "user", "cy").incarnation  # (the column's default: one of its own)
        assert len(cy) == 32 and cy not in users.values()
        assert store.instances.sweep() == 1 and _row(store, "user", "cy").reserved == 0.0  # (by its id)
        store.db.downgrade("0014")
        with store.db.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM users")).scalar() == 3
            assert conn.execute(text("SELECT count(*) FROM teams")).scalar() == 1
    finally:
        store.close()


def test_the_web_chats_usage_of_a_user_made_again_counts_none_of_the_old_ones_requests(store):
    """The chat's usage panel (its requests and tokens from the spend logs, which keep a deleted user's
    id) shows a user made again under a deleted one's id only the requests made since."""
    from treeserve.gateway.chat.store import ChatStore

    chats = ChatStore(store.db, store.accounts)
    store.accounts.create_user("ann")
    key = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
    _settle(store, store.admission.admit(key, 0.0), 0.5)
    assert chats.usage("ann")["requests"] == 1
    store.accounts.delete_users(["ann"])
    store.accounts.create_user("ann")
    assert chats.usage("ann") == {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0,
                                  "max_budget": None}
    key = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
    _settle(store, store.admission.admit(key, 0.0), 0.25)
    assert chats.usage("ann") == {"requests": 1, "prompt_tokens": 1, "completion_tokens": 1, "cost": 0.25,
                                  "max_budget": None}


def test_the_spend_logs_of_a_user_id_tell_a_deleted_users_requests_from_the_new_ones(store):
    """/spend/logs?user_id= lists every request under the id (LiteLLM's logs keep user ids as strings),
    the deleted account's among them; nothing told them apart, the old account's history read as the
    new one's. Each row now says whether its user is gone (`user_deleted`); the new account's own
    views (/user/info's spend) count none of the old one's."""
    store.accounts.create_user("ann")
    store.accounts.create_user("bob")
    old = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
    bob = store.accounts.authenticate(store.accounts.create_key(user_id="bob")[0])
    held = [store.admission.admit(k, 0.0) for k in (old, bob)]  # (each alive: its id names its request)
    _settle(store, held[0], 0.5)
    in_flight, started = store.admission.admit(old, 0.0), utcnow()  # (settled once ann is made again)
    store.accounts.delete_users(["ann"])
    store.accounts.create_user("ann")
    _settle(store, in_flight, 0.125, started)
    new = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
    held.append(store.admission.admit(new, 0.0))
    _settle(store, held[2], 0.25)
    _settle(store, held[1], 1.0)
    store.accounts.delete_users(["bob"])
    rows = store.ledger.spend_logs(user_id="ann")
    assert [(r["cost"], r["user_deleted"]) for r in rows] == [(0.5, True), (0.125, True), (0.25, False)]
    assert [r["user_deleted"] for r in store.ledger.spend_logs(user_id="bob")] == [True]  # (deleted, not made again)
    assert store.accounts.user_info("ann")["user_info"]["spend"] == 0.25
    assert "user_deleted" in logs_csv(rows).splitlines()[0]


def test_two_processes_sweeping_at_once_give_a_dead_ones_holdings_back_once(request):
    """Every gateway process sweeps: two that find the same dead process's holdings at the same moment
    (PostgreSQL, read committed: both read them before either deletes them) gave each back twice, its
    key's, user's and team's `reserved` below 0 (their budgets then over-admitting by as much)."""
    import threading
    import time

    from treeserve.gateway.schema import ApiKey

    url = request.getfixturevalue("postgres").new_database()
    store = Store(url)
    store.migrate()
    sweepers = [Store(url), Store(url)]
    try:
        store.teams.create_team("t", [], max_budget=1.0)
        key = store.accounts.authenticate(store.accounts.create_key(team_id="t", user_id="ann", max_budget=1.0)[0])
        store.admission.admit(key, 0.25)
        long_ago = utcnow() - dt.timedelta(minutes=5)
        with store.db.transaction() as s:  # (this process is dead)
            s.execute(update(Holding).values(created_at=long_ago))
        swept: list[int] = []
        with store.db.transaction() as blocker:  # the key's row held: both sweeps read, then wait on it
            blocker.execute(update(ApiKey).values(spend=ApiKey.spend))
            threads = [threading.Thread(target=lambda s=s: swept.append(s.instances.sweep())) for s in sweepers]
            for thread in threads:
                thread.start()
            time.sleep(1.5)
        for thread in threads:
            thread.join(30)
        assert sorted(swept) == [0, 1]
        with store.db.session() as s:
            reserved = (s.scalars(select(ApiKey.reserved)).one(), s.get(User, "ann").reserved, s.get(Team, "t").reserved)
        assert reserved == (0.0, 0.0, 0.0)
    finally:
        for each in (store, *sweepers):
            each.close()


def test_a_request_of_the_old_account_started_as_the_new_one_was_made_is_told_apart_by_incarnation(store):
    """`user_deleted` compared a request's start with the current account's `created_at`: a request of
    the deleted account that started in the instant the new one was made (or on a gateway whose clock
    runs ahead) read as the new account's, and one of the new account on a gateway whose clock runs
    behind as the deleted one's. Each row names the user row it was admitted on (migration 0016)."""
    from treeserve.gateway.chat.store import ChatStore

    store.accounts.create_user("ann")
    old = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
    in_flight = store.admission.admit(old, 0.0)  # (the old account's, settled once ann is made again)
    store.accounts.delete_users(["ann"])
    store.accounts.create_user("ann")
    made_at = _row(store, "user", "ann").created_at
    _settle(store, in_flight, 0.5, made_at)  # (started the instant the new account was made)
    new = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
    _settle(store, store.admission.admit(new, 0.0), 0.25, made_at - dt.timedelta(seconds=1))  # (a clock behind)
    rows = store.ledger.spend_logs(user_id="ann")
    assert [(r["cost"], r["user_deleted"]) for r in rows] == [(0.25, False), (0.5, True)]
    assert logs_csv(rows).splitlines()[1].endswith(",False")
    usage = ChatStore(store.db, store.accounts).usage("ann")
    assert (usage["requests"], usage["prompt_tokens"]) == (1, 1)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_spend_log_incarnations_migration_upgrades_and_downgrades_with_rows(backend, request, tmp_path):
    """Migration 0016 on a database at 0015 with spend rows: they keep their rows and are told apart by
    time (they name no incarnation), a gateway from before 0016 still running writes rows without it,
    the schema is exactly the ORM's, and downgrading to 0015 keeps every row."""
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else \
        request.getfixturevalue("postgres").new_database()
    old = _store_at_revision(url, "0015")
    made_at = utcnow() - dt.timedelta(hours=1)
    insert_log = text("INSERT INTO spend_logs (request_id, key_id, user_id, model, route, stream, status, "
                      "prompt_tokens, completion_tokens, cost, started_at, ended_at) "
                      "VALUES (:r, 1, 'ann', 'm', 'chat', :no, 'success', 1, 1, :c, :t, :t)")
    with old.db.transaction() as conn:
        conn.execute(text("INSERT INTO users (user_id, spend, reserved, metadata, created_at) "
                          "VALUES ('ann', 0, 0, '{}', :t)"), {"t": made_at})
        for request_id, cost, started in (("before", 0.5, made_at - dt.timedelta(minutes=1)), ("since", 0.25, made_at)):
            conn.execute(insert_log, {"r": request_id, "no": False, "c": cost, "t": started})
    old.close()
    store = Store(url)
    try:
        store.migrate()
        assert store.db.revision() == migrations_head()
        with store.db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        with store.db.transaction() as conn:  # a gateway from before 0016 still running: no incarnation
            conn.execute(insert_log, {"r": "rolling", "no": False, "c": 0.125, "t": utcnow()})
        rows = store.ledger.spend_logs(user_id="ann")
        assert [(r["request_id"], r["user_deleted"]) for r in rows] == [("before", True), ("since", False),
                                                                         ("rolling", False)]
        key = store.accounts.authenticate(store.accounts.create_key(user_id="ann")[0])
        _settle(store, store.admission.admit(key, 0.0), 1.0)
        with store.db.session() as s:
            assert s.get(User, "ann").incarnation == s.execute(
                text("SELECT user_incarnation FROM spend_logs WHERE cost = 1.0")).scalar()
        store.db.downgrade("0015")
        assert store.db.revision() == "0015"
        with store.db.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM spend_logs")).scalar() == 4
            assert conn.execute(text("SELECT sum(cost) FROM spend_logs")).scalar() == pytest.approx(1.875)
    finally:
        store.close()
