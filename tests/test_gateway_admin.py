"""The admin API as LiteLLM's clients and admin UI call it (a helper's audit of an operator's first
hour after LiteLLM): /key/list and /user/list with their filters, pages and answers, /key/delete by
alias, and /user/info's teams; on SQLite and PostgreSQL. No backend is needed: nothing is served."""
from __future__ import annotations

import contextlib
import logging

import httpx
import pytest

from conftest import running_server
from test_gateway_security import stand_in_backend
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-admin-test"


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
        assert client.get("/key/list", params={"team_id": "t"}).json()["keys"] == []  # (test_gateway_teams)
        for bad in ({"organization_id": "o"}, {"include_team_keys": "true"}, {"size": 101},
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
        # LiteLLM's user fields this gateway lacks: a 400 saying why, not `unknown parameter` (a typo's
        # answer); a null one asks for nothing and is dropped
        for route, body in (("/user/new", {"user_id": "dan", "user_role": "internal_user"}),
                            ("/user/new", {"user_id": "dan", "user_email": "dan@example.com"}),
                            ("/user/update", {"user_id": "ann", "user_email": "ann@example.com"})):
            refused = client.post(route, json=body)
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["code"] == "unsupported_parameter", refused.text
            assert error["param"] in body and "not supported" in error["message"], error
        assert client.post("/user/new", json={"user_id": "dan", "user_email": None}).status_code == 200


def test_litellms_every_model_names_and_key_fields_this_gateway_lacks(database):
    """LiteLLM's `all-proxy-models` (and a team key's `all-team-models`) in `models` is every model: the
    key is made (it was a 400 "'all-proxy-models' is not served by this gateway"), with the empty list that
    allows every model here. LiteLLM's key fields this gateway lacks (`tags`, `guardrails`, ...) are a 400
    saying so, as a team's are; they were `unknown parameter`, a typo's answer."""
    with admin(database) as client:
        for sentinel in ("all-proxy-models", "all-team-models"):
            made = client.post("/key/generate", json={"models": [sentinel]})
            assert made.status_code == 200 and made.json()["models"] == [], made.text
        team = client.post("/team/new", json={"models": ["all-proxy-models"]})
        assert team.status_code == 200 and team.json()["models"] == [], team.text
        for field, value in (("tags", ["a"]), ("guardrails", ["g"]), ("model_max_budget", {"gen": 1})):
            refused = client.post("/key/generate", json={field: value})
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["code"] == "unsupported_parameter", refused.text
            assert error["param"] == field and "not supported" in error["message"], error
        assert client.post("/key/generate", json={"tags": None}).status_code == 200  # (asks for nothing)


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


def _self_info(client: httpx.Client, key: str) -> httpx.Response:
    """/key/info read by the key itself: 200 while the key works, 401 once it does not."""
    return client.get("/key/info", headers={"Authorization": f"Bearer {key}"})


def test_user_new_makes_the_user_and_a_key_as_litellms(database):
    """LiteLLM's /user/new makes a key for the user unless auto_create_key is false (its answer's
    `key`, with the user's models and metadata, and the key fields given); user_id may be left out (a
    UUID). It made the user only: a LiteLLM script reading the answer's `key` found none."""
    with admin(database) as client:
        made = client.post("/user/new", json={"user_id": "ann", "models": ["gen"], "max_budget": 5.0,
                                              "metadata": {"team": "a"}, "key_alias": "ann-laptop", "rpm_limit": 7,
                                              "duration": "30d"})
        assert made.status_code == 200, made.text
        answer = made.json()
        key = answer["key"]
        assert key.startswith("sk-") and answer["user_id"] == "ann" and answer["max_budget"] == 5.0
        assert answer["models"] == ["gen"] and answer["key_alias"] == "ann-laptop" and answer["expires"]
        assert answer["user_info"]["max_budget"] == 5.0 and answer["teams"] == []
        [record] = answer["keys"]
        assert record["token"] != key and record["token"] == client.get("/key/list").json()["keys"][0]
        assert key not in client.get("/key/list", params={"return_full_object": True}).text  # (stored hashed)
        own = _self_info(client, key).json()["info"]
        assert {k: own[k] for k in ("user_id", "models", "metadata", "rpm_limit", "max_budget", "key_alias")} == {
            "user_id": "ann", "models": ["gen"], "metadata": {"team": "a"}, "rpm_limit": 7, "max_budget": None,
            "key_alias": "ann-laptop"}  # (the user's budget governs the key, as LiteLLM's)
        anonymous = client.post("/user/new", json={}).json()
        assert len(anonymous["user_id"]) == 36 and anonymous["key"].startswith("sk-")
        bare = client.post("/user/new", json={"user_id": "bob", "auto_create_key": False}).json()
        assert bare["key"] is None and bare["keys"] == []
        assert client.get("/user/info", params={"user_id": "bob"}).json()["keys"] == []
        refused = client.post("/user/new", json={"user_id": "cat", "auto_create_key": False, "key_alias": "c"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "key_alias", refused.text
        taken = client.post("/user/new", json={"user_id": "dee", "key_alias": "ann-laptop"})
        assert taken.status_code == 400 and taken.json()["error"]["code"] == "key_alias_exists", taken.text
        assert client.get("/user/info", params={"user_id": "dee"}).status_code == 404  # (all or nothing)
        assert client.post("/user/new", json={"user_id": "ann"}).status_code == 400  # (user_exists)


def test_keys_are_regenerated_by_path_or_body_as_litellms(database):
    """LiteLLM's POST /key/{key}/regenerate (it was a 404) and /key/regenerate with the key in the
    body: a new secret for the same key (its id, alias, spend stay), the old one refused at once (this
    process's key cache forgets it); `new_key` chooses the secret, the other fields change with it."""
    with admin(database) as client:
        created = client.post("/key/generate", json={"key_alias": "team-a", "models": ["gen"]}).json()
        key = created["key"]
        assert _self_info(client, key).status_code == 200  # (now in the key cache)
        renewed = client.post(f"/key/{key}/regenerate", json={"max_budget": 9.0, "rpm_limit": 5})
        assert renewed.status_code == 200, renewed.text
        fresh = renewed.json()
        assert fresh["key"] != key and fresh["key_id"] == created["key_id"] and fresh["key_alias"] == "team-a"
        assert fresh["max_budget"] == 9.0 and fresh["rpm_limit"] == 5 and fresh["models"] == ["gen"]
        assert fresh["token"] != created["token"] and fresh["key_name"].endswith(fresh["key"][-4:])
        assert _self_info(client, key).status_code == 401
        assert _self_info(client, fresh["key"]).json()["info"]["key_id"] == created["key_id"]
        by_hash = client.post(f"/key/{fresh['token']}/regenerate")  # (no body: LiteLLM's body is optional)
        assert by_hash.status_code == 200 and by_hash.json()["key_id"] == created["key_id"], by_hash.text
        chosen = "sk-chosen-" + "x" * 24
        in_body = client.post("/key/regenerate", json={"key": by_hash.json()["key"], "new_key": chosen}).json()
        assert in_body["key"] == chosen and _self_info(client, chosen).status_code == 200
        other = client.post("/key/generate", json={}).json()["key"]
        refusals = [(f"/key/{other}/regenerate", {"new_key": chosen}, 400, "new_key"),
                    (f"/key/{other}/regenerate", {"new_key": "not-sk"}, 400, "new_key"),
                    (f"/key/{other}/regenerate", {"key_alias": "team-a"}, 400, "key_alias"),
                    (f"/key/{other}/regenerate", {"new_master_key": "sk-new-master"}, 400, "new_master_key"),
                    ("/key/sk-no-such-key/regenerate", None, 404, "key"), ("/key/regenerate", {}, 400, "key")]
        for path, body, status, param in refusals:
            refused = client.post(path, json=body)
            assert refused.status_code == status and param in refused.json()["error"]["param"], (path, refused.text)
        assert _self_info(client, other).status_code == 200  # (a refused regenerate changed nothing)
        assert client.post(f"/key/{other}/regenerate", headers={"Authorization": f"Bearer {other}"}).status_code == 401


def test_a_key_in_a_regenerate_path_stays_out_of_the_log(tmp_path, caplog):
    """The admin API logs each call's method and path, never a key; /key/{key}/regenerate puts the
    key in the path, and every call to it (refused or not) wrote the live key into the gateway's log."""
    caplog.set_level(logging.INFO, logger="treeserve.gateway")
    with admin(f"sqlite:///{tmp_path / 'gateway.db'}") as client:
        key = client.post("/key/generate", json={}).json()["key"]
        intruder = client.post(f"/key/{key}/regenerate", headers={"Authorization": "Bearer sk-wrong"})
        refused = client.post(f"/key/{key}/regenerate", json={"new_key": "not-sk"})
        renewed = client.post(f"/key/{key}/regenerate")
    assert (intruder.status_code, refused.status_code, renewed.status_code) == (401, 400, 200)
    assert key[3:] not in caplog.text and renewed.json()["key"][3:] not in caplog.text
    assert "/key/{key:path}/regenerate" in caplog.text  # (the route is still named)


def test_answers_carry_the_fields_litellms_clients_read(database):
    """What a LiteLLM script reads from the answers: /key/generate's and /key/regenerate's `token_id`
    (the key's hash), /key/update's `key`, /user/update's `data` (the user's row); they were missing."""
    with admin(database) as client:
        made = client.post("/key/generate", json={"key_alias": "k"}).json()
        assert made["token_id"] == made["token"] and made["key"].startswith("sk-")
        renewed = client.post(f"/key/{made['key']}/regenerate").json()
        assert renewed["token_id"] == renewed["token"] != made["token"]
        updated = client.post("/key/update", json={"key": renewed["key"], "rpm_limit": 3}).json()
        assert updated["key"] == renewed["key"] and updated["rpm_limit"] == 3
        client.post("/user/new", json={"user_id": "ann", "auto_create_key": False})
        user = client.post("/user/update", json={"user_id": "ann", "max_budget": 2.0}).json()
        assert user["user_id"] == "ann" and user["data"]["max_budget"] == 2.0 and user["data"] == user["user_info"]


def test_an_admin_call_naming_more_ids_than_a_statement_holds_is_a_400_naming_the_field(database):
    """Each id a delete (or a team's members) names is a parameter of one statement, and PostgreSQL takes at
    most 65,535: past them psycopg failed before sending, read as an outage, so `/key/delete` of 70,000 keys
    was a 503 `database_unavailable` to retry for ever (on SQLite, a 404 after reading them all). Now
    more than 10,000 in one call is a 400 naming the field, on every database; the keys named are kept."""
    with admin(database) as client:
        kept = _keys(client, 1)[0]
        many = [f"sk-{i}" for i in range(70_000)]
        for path, body, field in [("/key/delete", {"keys": many + [kept["key"]]}, "keys"),
                                  ("/key/delete", {"key_aliases": many}, "key_aliases"),
                                  ("/user/delete", {"user_ids": many}, "user_ids"),
                                  ("/team/delete", {"team_ids": many}, "team_ids"),
                                  ("/team/new", {"members_with_roles": [{"user_id": u} for u in many]},
                                   "members_with_roles"),
                                  ("/team/member_add", {"team_id": "t", "member": [{"user_id": u} for u in many]},
                                   "member")]:
            refused = client.post(path, json=body)
            assert refused.status_code == 400, (path, refused.text)
            assert refused.json()["error"]["param"] == field and "10000" in refused.json()["error"]["message"]
        assert client.get("/key/info", params={"key": kept["key"]}).status_code == 200
        assert client.get("/health/readiness").status_code == 200
        ten_thousand = client.post("/key/delete", json={"keys": many[:10_000]})  # (as many as a call may name)
        assert ten_thousand.status_code == 404 and ten_thousand.json()["error"]["code"] == "key_not_found"


def test_a_key_brought_from_another_gateway_is_generated_with_its_own_secret(database):
    """LiteLLM's /key/generate takes `key`, the secret to give the key (how keys move from one proxy to
    another, their clients unchanged); it was a 400 `unknown parameter`. The secret is stored hashed,
    another key's secret is a 400 naming `key`, and one not starting `sk-` too (LiteLLM's rule)."""
    import hashlib

    with admin(database) as client:
        brought = "sk-brought-from-litellm-0001"
        made = client.post("/key/generate", json={"key": brought, "key_alias": "moved", "max_budget": 2.0})
        assert made.status_code == 200, made.text
        assert made.json()["key"] == brought and made.json()["token"] == hashlib.sha256(brought.encode()).hexdigest()
        models = httpx.get(str(client.base_url) + "/v1/models", headers={"Authorization": f"Bearer {brought}"})
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["gen"]
        listed = client.get("/key/list", params={"return_full_object": "true"}).text
        assert brought not in listed and brought[3:] not in listed
        taken = client.post("/key/generate", json={"key": brought})
        assert taken.status_code == 400 and taken.json()["error"]["param"] == "key", taken.text
        assert taken.json()["error"]["code"] == "key_exists"
        unprefixed = client.post("/key/generate", json={"key": "brought-0002"})
        assert unprefixed.status_code == 400 and unprefixed.json()["error"]["param"] == "key"
        assert client.get("/key/list").json()["total_count"] == 1


def test_a_chosen_secret_that_no_client_could_send_is_shown_whole_or_is_the_master_key_is_a_400(tmp_path):
    """/key/generate's `key` and /key/regenerate's `new_key` took any text starting `sk-`: `sk-1234` was a
    key whose name `sk-...1234`, shown by /key/list, the metrics and the logs, is the whole secret; one
    ending in a space or with a character past ASCII was a key that no request could ever use (a header
    cannot carry it as stored); the master key itself was taken, its SHA-256 stored and listed, the key
    never used (the master key is checked first). Each is now a 400 naming the field, never echoing it."""
    with admin(f"sqlite:///{tmp_path / 'gateway.db'}") as client:
        other = client.post("/key/generate", json={}).json()["key"]
        for secret in ("sk-", "sk-1234", "sk-" + "x" * 15, "sk-" + "x" * 20 + " ", "sk-" + "é" * 20,
                       "sk-abc def" + "x" * 20, "sk-\t" + "x" * 20, MASTER):
            for path, field in (("/key/generate", "key"), (f"/key/{other}/regenerate", "new_key")):
                refused = client.post(path, json={field: secret})
                assert refused.status_code == 400, (path, secret, refused.text)
                assert refused.json()["error"]["param"] == field
                assert secret == "sk-" or secret[3:].strip() not in refused.text
        assert client.get("/key/list").json()["total_count"] == 1
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {other}"}).status_code == 200  # (kept)
        shortest = "sk-" + "0123456789abcdef"
        made = client.post("/key/generate", json={"key": shortest})
        assert made.status_code == 200 and made.json()["key"] == shortest, made.text
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {shortest}"}).status_code == 200


def test_user_list_naming_more_ids_than_a_call_may_is_a_400_naming_user_ids(tmp_path):
    """/user/list's `user_ids` (comma-separated, up to 64 KiB: 32,768 ids) was the one id list an admin
    call could name past 10,000, each a parameter of its statement (SQLite takes 32,766): now a 400, as
    /user/delete's list; 10,000 are answered."""
    with admin(f"sqlite:///{tmp_path / 'gateway.db'}") as client:
        client.post("/user/new", json={"user_id": "ann", "auto_create_key": False})
        refused = client.get("/user/list", params={"user_ids": ",".join(["ann"] * 10_001)})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "user_ids", refused.text
        assert "10000" in refused.json()["error"]["message"]
        listed = client.get("/user/list", params={"user_ids": ",".join(["ann"] * 10_000)})
        assert listed.status_code == 200 and [u["user_id"] for u in listed.json()["users"]] == ["ann"]
