"""What a LiteLLM proxy user or client library notices first, on SQLite and PostgreSQL: LiteLLM's
probes (`/health/liveliness` "I'm alive!", `/health/readiness` with its `db` status, both public and
answered while draining; `/health` with a key: the models' health), `/model/info`'s `litellm_params`
with no secret in them, `/user/delete`'s count, a 403 `model_not_allowed` in `key_requests_total`,
and `treeserve gateway users create` making a key as `/user/new` does."""
from __future__ import annotations

import contextlib
import json

import httpx
import pytest
from sqlalchemy import create_engine, text

from conftest import running_server
from gateway_support import wait_for
from test_gateway_security import stand_in_backend
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-parity-master"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
UPSTREAM_SECRET = "sk-upstream-provider-secret"
DEAD = "http://127.0.0.1:9"  # (the discard port: nothing listens)


@contextlib.contextmanager
def gateway(database: str, health_interval: float = 0.0):
    """Model `gen` on a stand-in backend (sent an upstream api_key), `other` on one that never answers."""
    backend = stand_in_backend()
    backend.get("/health")(lambda: {"status": "ok"})  # (what the gateway's health check asks)
    with running_server(backend) as backend_url:
        models = {"gen": ModelConfig("gen", [BackendConfig(backend_url, api_key=UPSTREAM_SECRET, model="gen-7b")]),
                  "other": ModelConfig("other", [BackendConfig(DEAD)])}
        app = build_app(GatewayConfig(models=models, master_key=MASTER, database=database,
                                      health_interval=health_interval))
        with running_server(app) as url:
            with httpx.Client(base_url=url, timeout=30) as client:
                yield client, app, backend_url


def _key(client: httpx.Client, **fields) -> str:
    made = client.post("/key/generate", json=fields, headers=ADMIN)
    assert made.status_code == 200, made.text
    return made.json()["key"]


def test_litellms_probes_answer_as_litellms_and_health_with_a_key_reports_the_models(database):
    """LiteLLM's /health/liveliness (and /health/liveness) answer the JSON string "I'm alive!",
    /health/readiness `{"status": "connected", "db": "connected", ...}`, with no key; both stay
    answered while the gateway drains (readiness 503, liveness 200). /health without a key stays the
    liveness `{"status": "ok"}` that scripts and load balancers poll; with a key it is LiteLLM's
    report of the models that key may use. Before: `{"status": "ok"}` from all of them, and the
    LiteLLM-named probes were refused 503 while draining."""
    with gateway(database, health_interval=0.1) as (client, app, backend_url):
        for path in ("/health/liveliness", "/health/liveness"):
            alive = client.get(path)
            assert alive.status_code == 200 and alive.json() == "I'm alive!", (path, alive.text)
        ready = client.get("/health/readiness")
        assert ready.status_code == 200, ready.text
        assert {k: ready.json()[k] for k in ("status", "db", "cache")} == {"status": "connected", "db": "connected",
                                                                           "cache": None}
        assert ready.json()["last_updated"] and ready.json()["success_callbacks"] == []
        assert client.get("/health").json() == {"status": "ok"}  # (no key: liveness, as before)
        assert client.get("/health", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401

        report = wait_for(lambda: (r := client.get("/health", headers=ADMIN).json())["unhealthy_count"] and r)
        assert report["healthy_endpoints"] == [{"model": "gen", "api_base": backend_url}]
        assert [(e["model"], e["api_base"]) for e in report["unhealthy_endpoints"]] == [("other", DEAD)]
        assert report["unhealthy_endpoints"][0]["error"] and report["healthy_count"] == 1
        limited = _key(client, models=["gen"])
        mine = client.get("/health", headers={"Authorization": f"Bearer {limited}"}).json()
        assert (mine["healthy_count"], mine["unhealthy_count"]) == (1, 0)  # (only the models the key may use)
        assert UPSTREAM_SECRET not in json.dumps(report)

        app.state.drain.begin()
        assert client.get("/health/liveliness").status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/health/readiness").status_code == 503


def test_health_with_a_key_checks_the_model_named_in_its_query(database):
    """LiteLLM's `/health?model=NAME` reports that model's backends alone (matched by the gateway's name
    or the backend's own, as LiteLLM matches `model_name` or `litellm_params.model`); a model the key
    may not use, or none of that name, is an empty report, never its backends. Before: `model` was
    ignored and every model the key may use was reported."""
    with gateway(database) as (client, _, _):
        def endpoints(headers, model):
            report = client.get("/health", params={"model": model}, headers=headers).json()
            assert report["healthy_count"] + report["unhealthy_count"] == len(
                report["healthy_endpoints"] + report["unhealthy_endpoints"]), report
            return [e["model"] for e in report["healthy_endpoints"] + report["unhealthy_endpoints"]]

        assert endpoints(ADMIN, "gen") == ["gen"] and endpoints(ADMIN, "other") == ["other"]
        assert endpoints(ADMIN, "gen-7b") == ["gen"]  # (the backend's own name for it)
        assert endpoints(ADMIN, "nothing") == []
        limited = {"Authorization": f"Bearer {_key(client, models=['gen'])}"}
        assert endpoints(limited, "other") == [] and endpoints(limited, "gen") == ["gen"]


def test_model_info_has_litellm_params_without_secrets(database):
    """LiteLLM's /model/info (and /v1/model/info): an entry per deployment with its `litellm_params`
    (`model` as the backend knows it, `api_base`), never the backend's api_key nor the password in
    its URL. Before: no `litellm_params` at all."""
    with running_server(stand_in_backend()) as backend_url:
        secret_url = backend_url.replace("http://", "http://ops:url-password@")
        shown_url = backend_url  # (a backend's label names no account: its user is an error's detail)
        models = {"gen": ModelConfig("gen", [BackendConfig(backend_url, api_key=UPSTREAM_SECRET, model="gen-7b"),
                                             BackendConfig(secret_url)], output_cost_per_token=2e-6)}
        app = build_app(GatewayConfig(models=models, master_key=MASTER, database=database, health_interval=0))
        with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            key = _key(client, models=["gen"])
            for path in ("/model/info", "/v1/model/info"):
                answer = client.get(path, headers={"Authorization": f"Bearer {key}"})
                assert answer.status_code == 200, answer.text
                assert UPSTREAM_SECRET not in answer.text and "url-password" not in answer.text
                assert "ops" not in answer.text
                data = answer.json()["data"]
                assert [(d["model_name"], d["litellm_params"]["model"], d["litellm_params"]["api_base"])
                        for d in data] == [("gen", "gen-7b", backend_url), ("gen", "gen", shown_url)]
                assert all("api_key" not in d["litellm_params"] for d in data)
                assert data[0]["model_info"]["output_cost_per_token"] == 2e-6
            assert client.get("/model/info").status_code == 401
            listed = client.get("/health/backends", headers=ADMIN).json()
            assert [b["url"] for b in listed] == [backend_url, shown_url]


def test_user_delete_answers_litellms_count(database):
    """LiteLLM's /user/delete answers its database's delete count, a bare JSON number (an id named
    twice is one user); before, `{"deleted_users": [...ids]}`."""
    with gateway(database) as (client, _, _):
        for user in ("ann", "bob", "cat"):
            assert client.post("/user/new", json={"user_id": user}, headers=ADMIN).status_code == 200
        deleted = client.post("/user/delete", json={"user_ids": ["ann", "bob", "ann"]}, headers=ADMIN)
        assert deleted.status_code == 200 and deleted.json() == 2, deleted.text
        assert client.post("/user/delete", json={"user_ids": ["cat", "nobody"]}, headers=ADMIN).status_code == 404
        assert client.post("/user/delete", json={"user_ids": ["cat"]}).status_code == 401
        users = client.get("/user/list", headers=ADMIN).json()["users"]
        assert [u["user_id"] for u in users] == ["cat"]


def test_a_model_the_key_may_not_use_is_counted_in_key_requests(database):
    """A 401 `model_not_allowed` (type `key_model_access_denied`, as LiteLLM's proxy answers) is a refusal of the key's request, counted in
    `key_requests_total{outcome}` by its code as a rate limit's or a budget's refusal is; it was not."""
    with gateway(database) as (client, _, _):
        key = _key(client, key_alias="gen-only", models=["gen"])
        refused = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "model_not_allowed"
        assert refused.json()["error"]["type"] == "key_model_access_denied"
        answered = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": "gen", "messages": [{"role": "user", "content": "x"}]})
        assert answered.status_code == 200, answered.text
        series = 'treeserve_gateway:key_requests_total{key="gen-only",outcome="%s"} 1.0'
        metrics = wait_for(lambda: series % "success" in (m := client.get("/metrics", headers=ADMIN).text) and m)
        assert series % "model_not_allowed" in metrics


def test_cli_users_create_makes_a_key_as_user_new_does_unless_no_key(database, capsys):
    """`treeserve gateway users create` answers as /user/new: a key for the user (with the user's
    models), shown once and stored hashed; `--no-key` makes the user only. Before: never a key."""
    from treeserve.cli import main

    with gateway(database) as (client, _, _):
        assert main(["gateway", "users", "create", "ann", "--models", "gen", "--database", database]) == 0
        made = json.loads(capsys.readouterr().out)
        key = made["key"]
        assert key.startswith("sk-") and made["user_id"] == "ann" and made["models"] == ["gen"]
        assert [k["user_id"] for k in made["keys"]] == ["ann"] and made["keys"][0]["models"] == ["gen"]
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
        assert [m["id"] for m in models] == ["gen"]
        with create_engine(database).connect() as conn:
            stored = str(conn.execute(text("SELECT * FROM api_keys")).all())
        assert key not in stored and key[3:] not in stored

        assert main(["gateway", "users", "create", "bob", "--no-key", "--database", database]) == 0
        bare = json.loads(capsys.readouterr().out)
        assert bare["key"] is None and bare["keys"] == [] and bare["user_id"] == "bob"
        info = client.get("/user/info", params={"user_id": "bob"}, headers=ADMIN).json()
        assert info["keys"] == []


def test_the_openai_client_pointed_at_the_gateway_without_v1_is_served_as_litellms(server, tmp_path):
    """LiteLLM's proxy answers its OpenAI routes without `/v1` too, and its quick start points the
    OpenAI client at `http://0.0.0.0:4000`, which then calls `/chat/completions`, `/models`, ...: such a
    client is served by the `/v1` routes themselves (the key's models, its budget, billing), and a
    request without a key is a 401 there as under `/v1`. Before: a 404 `route not found` for each."""
    import openai

    from test_gateway import MASTER as GATEWAY_MASTER, gateway as real_gateway

    with real_gateway(f"sqlite:///{tmp_path / 'gateway.db'}", [server.url]) as (url, _):
        admin = {"Authorization": f"Bearer {GATEWAY_MASTER}"}
        # (each answer costs 4 x 1e-3 and its prompt's tokens x 1e-6: the budget pays for two, not three)
        made = httpx.post(url + "/key/generate", json={"models": ["tiny"], "max_budget": 0.01}, headers=admin)
        client = openai.OpenAI(base_url=url, api_key=made.json()["key"], max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
        messages, fixed = [{"role": "user", "content": "Hello"}], {"min_tokens": 4}
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body=fixed)
        assert whole.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=fixed))
        assert chunks[-1].usage.completion_tokens == 4
        completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, extra_body=fixed)
        assert completion.usage.completion_tokens == 4
        with pytest.raises(openai.APIStatusError) as spent:  # (the key's own budget)
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert spent.value.body["code"] == "budget_exceeded"
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="other", messages=messages, max_tokens=4)
        rows = wait_for(lambda: len(r := httpx.get(url + "/spend/logs", headers=admin).json()) == 3 and r)
        assert sorted(row["route"] for row in rows) == ["chat", "chat", "completions"] and all(
            row["completion_tokens"] == 4 for row in rows)
        for path in ("/chat/completions", "/completions"):
            refused = httpx.post(url + path, json={"model": "tiny", "prompt": "x", "messages": messages})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/models").status_code == 401
        assert httpx.get(url + "/chat").status_code == 404  # (the web chat's path is not an OpenAI route: off here)


def test_a_key_reading_its_own_info_is_answered_its_hash_as_key(database):
    """LiteLLM's /key/info called with a virtual key and no `key` answers that key's hash as `key` (its
    caller's `api_key`, as its database keeps it); it was null. Never the secret itself."""
    with gateway(database) as (client, _, _):
        key = _key(client, key_alias="mine")
        own = client.get("/key/info", headers={"Authorization": f"Bearer {key}"})
        assert own.status_code == 200, own.text
        assert own.json()["key"] == own.json()["info"]["token"] and key not in own.text
        assert own.json()["info"]["key_alias"] == "mine"
