"""The admin API as LiteLLM's clients and admin UI call it (a helper's audit of an operator's first
hour after LiteLLM): /key/list and /user/list with their filters, pages and answers, /key/delete by
alias, and /user/info's teams; on SQLite and PostgreSQL. No backend is needed: nothing is served."""
from __future__ import annotations

import contextlib

import httpx
import pytest

from conftest import running_server
from test_gateway_security import stand_in_backend
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-admin-test"


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gateway.db'}"
    return request.getfixturevalue("postgres").new_database()


@contextlib.contextmanager
def admin(database: str, backend_url: str = "http://127.0.0.1:9"):
    models = {"gen": ModelConfig("gen", [BackendConfig(backend_url)], input_cost_per_token=1e-3,
                                 output_cost_per_token=1e-2)}
    app = build_app(GatewayConfig(models=models, master_key=MASTER, database=database, health_interval=0))
    with running_server(app) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {MASTER}"}, timeout=30) as client:
            yield client


def _keys(client: httpx.Client, count: int) -> list[dict]:
    made = [client.post("/key/generate", json={"key_alias": f"k{i}", "user_id": f"u{i % 2}"}) for i in range(count)]
    assert all(r.status_code == 200 for r in made), [r.text for r in made]
    return [r.json() for r in made]


def test_key_list_filters_pages_and_answers_as_litellms(database):
    """LiteLLM's /key/list: `keys` are hashes unless return_full_object, 10 a page by default, with
    total_count, current_page and total_pages; key_alias, key_hash, user_id, sort_by and sort_order
    filter and order it. They were silently ignored: every key, as records, whatever was asked."""
    with admin(database) as client:
        keys = _keys(client, 12)
        tokens = [k["token"] for k in keys]
        first = client.get("/key/list").json()
        assert first == {"keys": tokens[:10], "total_count": 12, "current_page": 1, "total_pages": 2}
        assert client.get("/key/list", params={"page": 2}).json()["keys"] == tokens[10:]
        assert client.get("/key/list", params={"page": 3}).json()["keys"] == []
        alias = client.get("/key/list", params={"key_alias": "k3", "return_full_object": "true"}).json()
        assert [k["key_alias"] for k in alias["keys"]] == ["k3"] and alias["total_count"] == 1
        for by in (keys[5]["key"], tokens[5]):
            assert client.get("/key/list", params={"key_hash": by}).json()["keys"] == [tokens[5]]
        owned = client.get("/key/list", params={"user_id": "u1", "size": 100}).json()
        assert owned["keys"] == tokens[1::2] and owned["total_pages"] == 1
        ordered = client.get("/key/list", params={"sort_by": "key_alias", "size": 3, "return_full_object": True})
        assert [k["key_alias"] for k in ordered.json()["keys"]] == ["k9", "k8", "k7"]  # (LiteLLM's desc)
        ascending = client.get("/key/list", params={"sort_by": "key_alias", "sort_order": "asc", "size": 2})
        assert ascending.json()["keys"] == [tokens[0], tokens[1]]  # ("k0", "k1")
        for bad in ({"team_id": "t"}, {"organization_id": "o"}, {"include_team_keys": "true"}, {"size": 101},
                    {"page": 0}, {"sort_by": "nope"}):
            refused = client.get("/key/list", params=bad)
            assert refused.status_code == 400, (bad, refused.text)
            assert list(bad)[0] in refused.json()["error"]["param"], refused.text


def test_user_list_filters_and_pages_as_litellms_and_user_info_has_teams(database):
    """LiteLLM's /user/list: `user_ids` (comma-separated), page and page_size (25), sort_by and
    sort_order, with total, page, page_size and total_pages; filters on what users here lack are a 400.
    /user/info carries LiteLLM's `teams` (none here), which its admin UI reads."""
    with admin(database) as client:
        for name in ("cat", "ann", "bob"):
            assert client.post("/user/new", json={"user_id": name}).status_code == 200
        listed = client.get("/user/list").json()
        assert [u["user_id"] for u in listed["users"]] == ["cat", "ann", "bob"]  # (the order they were made)
        assert {k: listed[k] for k in ("total", "page", "page_size", "total_pages")} == {
            "total": 3, "page": 1, "page_size": 25, "total_pages": 1}
        some = client.get("/user/list", params={"user_ids": "bob,cat", "sort_by": "user_id"}).json()
        assert [u["user_id"] for u in some["users"]] == ["bob", "cat"] and some["total"] == 2
        paged = client.get("/user/list", params={"page": 2, "page_size": 2, "sort_by": "user_id",
                                                 "sort_order": "desc"}).json()
        assert [u["user_id"] for u in paged["users"]] == ["ann"] and paged["total_pages"] == 2
        for bad in ({"role": "proxy_admin"}, {"user_email": "a@b"}, {"team": "t"}, {"page_size": 0}):
            refused = client.get("/user/list", params=bad)
            assert refused.status_code == 400 and list(bad)[0] in refused.json()["error"]["param"], refused.text
        assert client.get("/user/info", params={"user_id": "ann"}).json()["teams"] == []


def test_keys_are_deleted_by_their_aliases_as_litellms_key_aliases(database):
    """LiteLLM's /key/delete takes `key_aliases` as well as `keys`; it was a 400 about `keys`."""
    with admin(database) as client:
        keys = _keys(client, 3)
        missing = client.post("/key/delete", json={"key_aliases": ["k1", "nope"]})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "key_aliases"
        assert client.get("/key/list").json()["total_count"] == 3  # (none was deleted)
        deleted = client.post("/key/delete", json={"key_aliases": ["k1"], "keys": [keys[2]["key"]]})
        assert deleted.status_code == 200, deleted.text
        assert sorted(deleted.json()["deleted_keys"]) == sorted(["k1", keys[2]["key"]])
        assert client.get("/key/list").json()["keys"] == [keys[0]["token"]]
        for body in ({}, {"keys": []}, {"key_aliases": []}):
            refused = client.post("/key/delete", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "keys", refused.text


def test_spend_logs_rows_carry_litellms_field_names(tmp_path):
    """LiteLLM's spend log rows say `spend`, `user`, `startTime` and `endTime` (its admin UI and
    scripts read them); treeserve's rows had only its own names (cost, user_id, started_at, ended_at)."""
    with running_server(stand_in_backend()) as backend_url, \
            admin(f"sqlite:///{tmp_path / 'gateway.db'}", backend_url) as client:
        key = client.post("/key/generate", json={"user_id": "ann"}).json()["key"]
        answer = httpx.post(client.base_url.join("/v1/chat/completions"), headers={"Authorization": f"Bearer {key}"},
                            json={"model": "gen", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert answer.status_code == 200, answer.text
        row, = client.get("/spend/logs").json()
        assert row["spend"] == row["cost"] == pytest.approx(3e-3 + 2e-2) and row["user"] == "ann"
        assert (row["startTime"], row["endTime"]) == (row["started_at"], row["ended_at"]) and row["startTime"]
