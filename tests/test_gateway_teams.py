"""LiteLLM's teams: the /team/* admin routes, keys made for a team (held to its models, its budget
capping all its keys' spend together, that spend recorded on the team), a team deleted with its keys,
and migration 0014 from the previous head. On SQLite and PostgreSQL, through HTTP."""
from __future__ import annotations

import contextlib

import httpx
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from conftest import migrations_head, running_server
from test_gateway_security import stand_in_backend
from test_gateway_store import _store_at_revision, store  # noqa: F401 (a fixture: the store on each database)
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig
from treeserve.gateway.keys import hash_key
from treeserve.gateway.schema import Base
from treeserve.gateway.store import Store

MASTER = "sk-teams-test"
COST = 3 * 1e-3 + 2 * 1e-2  # the stand-in backend's usage (3 prompt, 2 completion tokens) at these prices


@contextlib.contextmanager
def gateway(database: str):
    """A gateway serving `gen` and `other` from a stand-in backend: (the admin client, the backend's app)."""
    backend = stand_in_backend()
    with running_server(backend) as backend_url:
        models = {name: ModelConfig(name, [BackendConfig(backend_url)], input_cost_per_token=1e-3,
                                    output_cost_per_token=1e-2) for name in ("gen", "other")}
        app = build_app(GatewayConfig(models=models, master_key=MASTER, database=database, health_interval=0))
        with running_server(app) as url:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {MASTER}"}, timeout=30) as client:
                yield client


def _chat(client: httpx.Client, key: str, model: str = "gen") -> httpx.Response:
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_team_routes_answer_as_litellms_and_only_to_the_master_key(database):
    """/team/new (team_id a UUID when left out; members made users), /team/info, /team/list (by
    team_alias; `user_id` filters by member), /team/update ({team_id, data}), /team/member_add and
    /team/member_delete, /team/delete; a virtual key gets 401 on each."""
    with gateway(database) as client:
        made = _ok(client.post("/team/new", json={"team_alias": "research", "models": ["gen"], "max_budget": 5,
                                                  "metadata": {"cc": "42"},
                                                  "members_with_roles": [{"user_id": "ann", "role": "admin"}]}))
        team_id = made["team_id"]
        assert len(team_id) == 36 and made["team_alias"] == "research" and made["models"] == ["gen"]
        assert made["max_budget"] == 5 and made["spend"] == 0 and made["metadata"] == {"cc": "42"}
        assert made["members_with_roles"] == [{"user_id": "ann", "role": "admin", "user_email": None}]
        assert _ok(client.get("/user/info", params={"user_id": "ann"}))["teams"][0]["team_id"] == team_id
        _ok(client.post("/team/new", json={"team_id": "alpha", "team_alias": "alpha"}))
        again = client.post("/team/new", json={"team_id": "alpha"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "team_id", again.text
        assert [t["team_id"] for t in _ok(client.get("/team/list"))] == ["alpha", team_id]  # (by alias)
        added = _ok(client.post("/team/member_add", json={"team_id": "alpha", "member": [{"user_id": "bob"}]}))
        assert added["members_with_roles"] == [{"user_id": "bob", "role": "user", "user_email": None}]
        assert [u["user_id"] for u in added["updated_users"]] == ["bob"]
        twice = client.post("/team/member_add", json={"team_id": "alpha", "member": {"user_id": "bob"}})
        assert twice.status_code == 400 and twice.json()["error"]["code"] == "member_exists", twice.text
        assert [t["team_id"] for t in _ok(client.get("/team/list", params={"user_id": "bob"}))] == ["alpha"]
        updated = _ok(client.post("/team/update", json={"team_id": "alpha", "max_budget": 2, "models": ["other"]}))
        assert updated["team_id"] == "alpha" and updated["data"]["max_budget"] == 2
        assert updated["data"]["models"] == ["other"] and updated["data"]["team_alias"] == "alpha"
        info = _ok(client.get("/team/info", params={"team_id": "alpha"}))
        assert set(info) == {"team_id", "team_info", "keys", "team_memberships"} and info["keys"] == []
        left = _ok(client.post("/team/member_delete", json={"team_id": "alpha", "user_id": "bob"}))
        assert left["members_with_roles"] == []
        gone = client.post("/team/member_delete", json={"team_id": "alpha", "user_id": "bob"})
        assert gone.status_code == 400 and gone.json()["error"]["param"] == "user_id", gone.text
        for bad, param in (({"team_alias": "x", "tpm_limit": 10}, "tpm_limit"), ({"models": ["nope"]}, "models")):
            refused = client.post("/team/new", json=bad)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        missing = client.get("/team/info", params={"team_id": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "team_id", missing.text
        key = _ok(client.post("/key/generate", json={"user_id": "ann"}))["key"]
        user = {"Authorization": f"Bearer {key}"}
        for method, path, body in (("POST", "/team/new", {"team_alias": "mine"}), ("GET", "/team/list", None),
                                   ("GET", "/team/info?team_id=alpha", None),
                                   ("POST", "/team/update", {"team_id": "alpha", "max_budget": 100}),
                                   ("POST", "/team/member_add", {"team_id": "alpha", "member": {"user_id": "ann"}}),
                                   ("POST", "/team/block", {"team_id": "alpha"}),
                                   ("POST", "/team/delete", {"team_ids": ["alpha"]})):
            refused = client.request(method, path, json=body, headers=user)
            assert refused.status_code == 401, (path, refused.text)
        assert _ok(client.get("/team/info", params={"team_id": "alpha"}))["team_info"]["max_budget"] == 2
        deleted = _ok(client.post("/team/delete", json={"team_ids": [team_id, "alpha"]}))
        assert deleted == {"deleted_teams": [team_id, "alpha"], "deleted_keys": 0}
        assert _ok(client.get("/team/list")) == [] and _ok(client.get("/user/info", params={"user_id": "ann"}))["teams"] == []


def test_a_team_key_is_held_to_the_teams_models_and_budget_and_its_spend_is_the_teams(database):
    """/key/generate with team_id: an unknown team is a 400 naming team_id, models outside the team's a
    400 naming models; a team key serves only the team's models; the team's max_budget caps its keys'
    spend together (the refusal is the key and user budgets' 429 budget_exceeded); the spend of each
    request is recorded on its key and its team (/team/info's `spend`, `keys`)."""
    with gateway(database) as client:
        team_id = _ok(client.post("/team/new", json={"team_alias": "t", "models": ["gen"],
                                                     "max_budget": 1.5 * COST}))["team_id"]
        unknown = client.post("/key/generate", json={"team_id": "nope"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "team_id", unknown.text
        assert "nope" in unknown.json()["error"]["message"]
        outside = client.post("/key/generate", json={"team_id": team_id, "models": ["other"]})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "models", outside.text
        moved = client.post("/key/update", json={"key": _ok(client.post("/key/generate", json={"models": ["other"]}))
                                                 ["key"], "team_id": team_id})
        assert moved.status_code == 400 and moved.json()["error"]["param"] == "models", moved.text
        first = _ok(client.post("/key/generate", json={"team_id": team_id, "user_id": "ann"}))
        second = _ok(client.post("/key/generate", json={"team_id": team_id, "models": ["gen"]}))
        assert first["team_id"] == team_id
        refused = _chat(client, first["key"], "other")
        assert refused.status_code == 401, refused.text  # (the team's models hold a key that names none)
        assert refused.json()["error"]["type"] == "team_model_access_denied"  # (LiteLLM's: the team refused it)
        assert "team can only access models=['gen']" in refused.json()["error"]["message"]
        _ok(_chat(client, first["key"]))
        _ok(_chat(client, second["key"]))  # (the team's spend, COST, is under its budget: admitted)
        for key in (first["key"], second["key"]):
            over = _chat(client, key)
            assert over.status_code == 429 and over.headers["x-should-retry"] == "false", over.text
            error = over.json()["error"]
            assert error["code"] == "budget_exceeded" and "team's budget" in error["message"], error
        info = _ok(client.get("/team/info", params={"team_id": team_id}))
        assert info["team_info"]["spend"] == pytest.approx(2 * COST) and info["team_info"]["reserved"] == 0
        assert sorted(k["spend"] for k in info["keys"]) == pytest.approx([COST, COST])
        assert _ok(client.get("/key/list", params={"team_id": team_id}))["total_count"] == 2
        _ok(client.post("/team/update", json={"team_id": team_id, "max_budget": 10}))
        _ok(_chat(client, second["key"]))  # (a raised team budget admits again)
        _ok(client.post("/team/update", json={"team_id": team_id, "blocked": True}))
        assert _chat(client, second["key"]).status_code == 401  # (LiteLLM's: a blocked team's keys stop)
        null = client.post("/team/update", json={"team_id": team_id, "blocked": None})
        assert null.status_code == 400, null.text
        _ok(client.post("/team/update", json={"team_id": team_id, "blocked": False}))
        _ok(_chat(client, second["key"]))
        assert _ok(client.post("/team/block", json={"team_id": team_id}))["blocked"] is True  # (LiteLLM's routes)
        blocked = _chat(client, second["key"])  # (LiteLLM's 401 says "Team=... is blocked": not a bad key)
        assert blocked.status_code == 401 and blocked.json()["error"]["code"] == "team_blocked", blocked.text
        assert f"team {team_id!r} is blocked" in blocked.json()["error"]["message"], blocked.text
        assert client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-no-such-key"},
                           json={"model": "gen", "messages": []}).json()["error"]["code"] == "invalid_api_key"
        assert _ok(client.post("/team/unblock", json={"team_id": team_id}))["blocked"] is False
        _ok(_chat(client, second["key"]))
        missing = client.post("/team/block", json={"team_id": "no-such-team"})
        assert missing.status_code == 404, missing.text


def test_deleting_a_team_deletes_its_keys(database):
    """LiteLLM's /team/delete deletes the team's keys with it: none is left that no team's budget or
    models hold. A key of another team, and one of no team, keep working."""
    with gateway(database) as client:
        doomed = _ok(client.post("/team/new", json={"team_id": "doomed", "max_budget": 100}))["team_id"]
        _ok(client.post("/team/new", json={"team_id": "kept"}))
        keys = [_ok(client.post("/key/generate", json={"team_id": t}))["key"] for t in (doomed, doomed, "kept")]
        loose = _ok(client.post("/key/generate", json={}))["key"]
        _ok(_chat(client, keys[0]))
        missing = client.post("/team/delete", json={"team_ids": [doomed, "ghost"]})
        assert missing.status_code == 404 and "ghost" in missing.json()["error"]["message"], missing.text
        _ok(_chat(client, keys[1]))  # (all or none: nothing was deleted)
        assert _ok(client.post("/team/delete", json={"team_ids": [doomed]})) == {"deleted_teams": [doomed],
                                                                                "deleted_keys": 2}
        for key in keys[:2]:
            assert _chat(client, key).status_code == 401
        _ok(_chat(client, keys[2]))
        _ok(_chat(client, loose))
        again = client.post("/key/generate", json={"team_id": doomed})
        assert again.status_code == 400 and again.json()["error"]["param"] == "team_id", again.text


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_teams_migration_upgrades_a_database_at_0013(backend, request, tmp_path):
    """Migration 0014 on a database an older gateway wrote (at 0013): its keys, users and holdings stay,
    with no team, and the schema is then exactly the ORM's."""
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else \
        request.getfixturevalue("postgres").new_database()
    old = _store_at_revision(url, "0013")
    token = "sk-an-older-gateways-key"
    with old.db.transaction() as conn:
        conn.execute(text("INSERT INTO users (user_id, spend, reserved, metadata, created_at) "
                          "VALUES ('ann', 0.5, 0, '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO api_keys (token_hash, key_name, user_id, spend, reserved, in_flight, blocked, "
                          "metadata, created_at, web_chat, max_budget) VALUES (:h, 'sk-...key', 'ann', 0.25, 0, 0, "
                          ":no, '{}', CURRENT_TIMESTAMP, :no, 1.0)"), {"h": hash_key(token), "no": False})
    old.close()
    store = Store(url)
    try:
        store.migrate()
        assert store.db.revision() == migrations_head()  # (0014, then the revisions after it)
        record = store.accounts.authenticate(token)
        assert record is not None and record.team_id is None and record.user_id == "ann" and record.budgeted
        info = store.accounts.key_info(token)
        assert info["team_id"] is None and info["spend"] == 0.25
        with store.db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        store.teams.create_team("t", [("ann", "user")])
        assert store.accounts.update_key(token, team_id="t")["team_id"] == "t"
        store.db.downgrade("0013")  # (and back: the key stays, without its team)
        with store.db.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM api_keys")).scalar() == 1
    finally:
        store.close()


def test_a_team_holding_of_a_dead_process_is_given_back_and_a_settled_one_spent(store):
    """A team key's request reserves its worst case on the team as on the key; the settlement moves
    its real cost into the team's spend; a dead process's holding is given back to the team too (a
    team budget held for good by a crashed gateway would refuse all its keys)."""
    import datetime as dt

    from sqlalchemy import select, update

    from treeserve.gateway.schema import Holding, Instance, Team, utcnow
    from treeserve.gateway.settlement import Settlement
    from treeserve.gateway.usage import Usage

    store.teams.create_team("t", [], max_budget=1.0)
    token, _ = store.accounts.create_key(team_id="t")
    key = store.accounts.authenticate(token)
    assert key.budgeted and key.team_id == "t"
    store.instances.heartbeat()
    settled = store.admission.admit(key, 0.25)
    store.ledger.settle(Settlement(settled, "done", "m", None, "chat", False, "success", Usage(1, 1), 0.1, utcnow()))
    store.ledger.flush()
    store.admission.admit(key, 0.3)  # this process then dies before settling it
    with store.db.session() as s:
        assert round(s.get(Team, "t").reserved, 9) == 0.3
    long_ago = utcnow() - dt.timedelta(minutes=5)
    with store.db.transaction() as s:
        s.execute(update(Instance).values(seen_at=long_ago))
        s.execute(update(Holding).values(created_at=long_ago))
    other = Store(store.db.url)
    try:
        assert other.instances.sweep() == 1
        with other.db.session() as s:
            team = s.scalars(select(Team)).one()
            assert round(team.reserved, 9) == 0.0 and team.spend == pytest.approx(0.1)
    finally:
        other.close()


def test_a_team_budget_holds_across_its_keys_under_concurrency(store):
    """20 requests at once on four keys of one team, each holding a quarter of the team's budget (the
    keys and their users have none): four are admitted, the rest refused as the team's budget
    (LiteLLM's tracker shows team budgets overshot under concurrency: here one conditional statement
    in the database decides)."""
    import concurrent.futures

    from treeserve.gateway.errors import BudgetExceeded

    store.teams.create_team("t", [], max_budget=1.0)
    keys = [store.accounts.authenticate(store.accounts.create_key(team_id="t", user_id=f"u{i}")[0]) for i in range(4)]

    def admit(i: int):
        try:
            return store.admission.admit(keys[i % 4], 0.25)
        except BudgetExceeded as refused:
            assert "team's budget" in refused.message
            return None
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        admitted = [r for r in pool.map(admit, range(20)) if r is not None]
    assert len(admitted) == 4
    assert store.teams.team("t")["reserved"] == pytest.approx(1.0)


def test_deleting_a_team_while_its_key_is_admitted_is_no_deadlock(store, monkeypatch):
    """/team/delete takes its rows' locks in admission's and the settlement's order (the team's keys,
    then the team): a request on a team key admitted while the team is deleted waits or is waited on,
    never a deadlock (PostgreSQL aborts one of the two: a 500 for a request or for the delete)."""
    import threading
    import time

    from treeserve.gateway import admission

    store.teams.create_team("t", [], max_budget=10.0)
    key = store.accounts.authenticate(store.accounts.create_key(team_id="t")[0])
    key_locked = threading.Event()
    original = admission._reserve

    def slow_reserve(conn, table, where, worst_cost, owner, held_by):
        if owner == "team":  # (the key's row is locked by now: let the delete start meanwhile)
            key_locked.set()
            time.sleep(0.5)
        return original(conn, table, where, worst_cost, owner, held_by)
    monkeypatch.setattr(admission, "_reserve", slow_reserve)
    errors = []

    def admit():
        try:
            store.admission.admit(key, 0.25)
        except Exception as exc:  # noqa: BLE001 (collected: the assertion shows it)
            errors.append(exc)
    thread = threading.Thread(target=admit)
    thread.start()
    assert key_locked.wait(10)
    store.teams.delete_teams(["t"])
    thread.join()
    assert errors == []
    assert store.teams.list_teams() == []


def test_a_team_budget_without_prices_is_warned_about(tmp_path):
    """As a key's or a user's: without prices every request costs 0, so a team's max_budget never
    acts; /team/new and /team/update answer with a warning saying so (none without a budget)."""
    from fastapi.testclient import TestClient

    models = {"gen": ModelConfig("gen", [BackendConfig("http://127.0.0.1:18999")])}
    app = build_app(GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'g.db'}",
                                  health_interval=0))
    with TestClient(app, headers={"Authorization": f"Bearer {MASTER}"}) as client:
        made = _ok(client.post("/team/new", json={"team_id": "t", "max_budget": 5}))
        assert "no model has a price" in made["warning"] and "max_budget never refuses" in made["warning"]
        assert "warning" not in _ok(client.post("/team/new", json={"team_id": "u"}))
        updated = _ok(client.post("/team/update", json={"team_id": "u", "max_budget": 1}))
        assert "no model has a price" in updated["warning"]
        assert "warning" not in _ok(client.post("/team/update", json={"team_id": "u", "team_alias": "x"}))


def test_the_gateway_builds_and_answers_query_parameters_without_pydantic_warnings(tmp_path):
    """FastAPI before 0.118.1 under Pydantic >= 2.12 warned for each query parameter ("The 'alias'
    attribute with value 'team_id' ... has no effect": FastAPI names each parameter's validator by an
    alias): pyproject.toml asks for a FastAPI that does not, and the app is built and /team/info?team_id=,
    /team/list?user_id= and /key/list?team_id= answered with every warning an error."""
    import tomllib
    import warnings
    from pathlib import Path

    from fastapi.testclient import TestClient
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    fastapi = next(Requirement(d) for d in project["project"]["dependencies"] if Requirement(d).name == "fastapi")
    assert not fastapi.specifier.contains(Version("0.118.0")), fastapi
    models = {"gen": ModelConfig("gen", [BackendConfig("http://127.0.0.1:18999")])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        app = build_app(GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'g.db'}",
                                      health_interval=0))
        with TestClient(app, headers={"Authorization": f"Bearer {MASTER}"}) as client:
            _ok(client.post("/team/new", json={"team_id": "t", "members_with_roles": [{"user_id": "ann"}]}))
            _ok(client.post("/key/generate", json={"team_id": "t"}))
            assert _ok(client.get("/team/info", params={"team_id": "t"}))["team_id"] == "t"
            assert [t["team_id"] for t in _ok(client.get("/team/list", params={"user_id": "ann"}))] == ["t"]
            assert _ok(client.get("/key/list", params={"team_id": "t"}))["total_count"] == 1
            assert client.get("/team/info").status_code == 400  # (team_id is required, as LiteLLM's)


def test_a_team_budget_with_a_duration_starts_again_when_its_period_ends(store):
    """LiteLLM's team budget_duration: /team/new sets budget_reset_at a period from now; a team whose
    budget is spent refuses its keys until then, and the first request after it finds the spend at 0
    and the next reset a period later; clearing the duration clears the reset."""
    import datetime as dt

    from sqlalchemy import update

    from treeserve.gateway.errors import BudgetExceeded
    from treeserve.gateway.schema import Team, utcnow
    from treeserve.gateway.settlement import Settlement
    from treeserve.gateway.usage import Usage

    made = store.teams.create_team("t", [], max_budget=1.0, budget_duration="30d")
    assert dt.datetime.fromisoformat(made["budget_reset_at"]) > utcnow() + dt.timedelta(days=29)
    key = store.accounts.authenticate(store.accounts.create_key(team_id="t")[0])
    spent = store.admission.admit(key, 1.0)
    store.ledger.settle(Settlement(spent, "r", "m", None, "chat", False, "success", Usage(1, 1), 1.0, utcnow()))
    with pytest.raises(BudgetExceeded) as refused:
        store.admission.admit(key, 0.1)
    assert "team's budget" in refused.value.message and refused.value.spent
    with store.db.transaction() as s:  # (the period ends)
        s.execute(update(Team).values(budget_reset_at=utcnow() - dt.timedelta(seconds=1)))
    store.admission.admit(key, 0.1)
    team = store.teams.team("t")
    assert team["spend"] == 0 and dt.datetime.fromisoformat(team["budget_reset_at"]) > utcnow() + dt.timedelta(days=29)
    assert store.teams.update_team("t", budget_duration=None)["budget_reset_at"] is None


def test_an_expired_key_of_a_blocked_team_is_an_invalid_key_not_a_blocked_one(store):
    """An expired key is no key (LiteLLM refuses it as expired before it looks at its team): a
    `team_blocked` refusal told its holder that it still exists and that unblocking its team would let
    it in again, which it would not."""
    import datetime as dt

    from sqlalchemy import update

    from treeserve.gateway.errors import TeamBlocked
    from treeserve.gateway.schema import ApiKey, utcnow

    store.teams.create_team("t", [])
    live, _ = store.accounts.create_key(team_id="t")
    expired, _ = store.accounts.create_key(team_id="t", key_alias="old")
    with store.db.transaction() as s:
        s.execute(update(ApiKey).where(ApiKey.key_alias == "old").values(expires_at=utcnow() - dt.timedelta(seconds=1)))
    store.teams.update_team("t", blocked=True)
    with pytest.raises(TeamBlocked):
        store.accounts.authenticate(live, explain=True)
    assert store.accounts.authenticate(expired, explain=True) is None
    assert store.accounts.authenticate(expired) is None and store.accounts.authenticate(live) is None


def test_a_blocked_teams_refusal_is_logged_as_every_other_401_is(database, caplog):
    """A key refused 401 is logged ("refused 401", the route, why); a key of a blocked team was refused
    401 (`team_blocked`) with no log line at all, so an operator reading the log saw nothing of it."""
    caplog.set_level("INFO", logger="treeserve.gateway")
    with gateway(database) as client:
        _ok(client.post("/team/new", json={"team_id": "t"}))
        key = _ok(client.post("/key/generate", json={"team_id": "t"}))["key"]
        _ok(client.post("/team/block", json={"team_id": "t"}))
        refused = _chat(client, key)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "team_blocked", refused.text
    logged = [r.getMessage() for r in caplog.records if r.name == "treeserve.gateway" and "refused 401" in r.getMessage()]
    assert logged == ["POST /v1/chat/completions refused 401: a key of blocked team 't'"], logged
    assert not any(key in r.getMessage() for r in caplog.records)
