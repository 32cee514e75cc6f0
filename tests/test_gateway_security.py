"""The gateway's security rules, checked route by route against a loopback stand-in backend: every
route the app has is public by design (probes, the chat's page and sign-in) or needs a key, the admin
ones the master key; a key limited to some models reaches no other through any route; one key's
files, batches and stored responses are missing to another's; a body past the limit is refused before
it is read, signed in or not; a password set by the admin API signs the user out everywhere."""
from __future__ import annotations

import contextlib
import json
import socket
import time
from urllib.parse import urlparse

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from chat_support import add_user
from conftest import running_server
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, ChatConfig, GatewayConfig, ModelConfig
from treeserve.gateway.routes import MAX_BODY_BYTES

MASTER = "sk-security-master"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
# public by design: load balancers' probes, the API's own description, the chat's page, assets and sign-in
PUBLIC = {"/health", "/health/ready", "/health/readiness", "/health/live", "/health/liveliness", "/health/liveness",
          "/openapi.json",
          "/docs", "/docs/oauth2-redirect", "/redoc", "/chat", "/chat/c/{conversation_id}", "/chat/static/{name}",
          "/chat/api/login"}
ADMIN_ONLY = {"/key/generate", "/key/list", "/key/update", "/key/block", "/key/unblock", "/key/regenerate",
              "/key/{key:path}/regenerate",
              "/key/delete", "/user/new", "/user/info", "/user/update", "/user/delete", "/user/list", "/spend/logs",
              "/spend/daily", "/health/backends", "/metrics"}


def stand_in_backend() -> FastAPI:
    """Answers a chat with its last message's text and a tokenize with a count; records each model named."""
    app = FastAPI()
    app.state.models = []
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        app.state.models.append(body.get("model"))
        text = str(body["messages"][-1]["content"])
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": usage}

    @app.post("/v1/completions")
    def completions(body: dict):
        app.state.models.append(body.get("model"))
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}], "usage": usage}

    @app.post("/tokenize")
    def tokenize(body: dict):
        app.state.models.append(body.get("model"))
        return {"count": 3, "max_model_len": 512, "tokens": [1, 2, 3]}

    return app


@contextlib.contextmanager
def gateway(tmp_path, chat: bool = False):
    backend = stand_in_backend()
    with running_server(backend) as backend_url:
        models = {name: ModelConfig(name, [BackendConfig(backend_url)]) for name in ("gen", "other")}
        app = build_app(GatewayConfig(models=models, master_key=MASTER, health_interval=0,
                                      database=f"sqlite:///{tmp_path / 'gateway.db'}",
                                      chat=ChatConfig(enabled=chat)))
        with running_server(app) as url:
            yield url, app, backend


def _routes(routes, prefix: str = ""):
    """(path, methods, dependency names) of every route, through included routers (FastAPI nests them)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _routes(route.original_router.routes, prefix + (route.include_context.prefix or ""))
        elif hasattr(route, "methods"):
            yield prefix + route.path, route.methods, _dependencies(getattr(route, "dependant", None))


def _dependencies(dependant) -> set[str]:
    names = set()
    for sub in dependant.dependencies if dependant is not None else ():
        names.add(getattr(sub.call, "__name__", str(sub.call)))
        names |= _dependencies(sub)
    return names


def _filled(path: str) -> str:
    return path.replace("{model:path}", "gen").replace("{key:path}", "sk-any").replace("{name}", "chat.js").replace("{conversation_id}", "c1") \
        .replace("{response_id}", "resp_1").replace("{file_id}", "file-1").replace("{batch_id}", "batch_1") \
        .replace("{message_id}", "1")


def test_every_route_is_public_by_design_or_needs_a_key_and_admin_routes_the_master_key(tmp_path):
    with gateway(tmp_path, chat=True) as (url, app, _):
        key = httpx.post(url + "/key/generate", json={}, headers=ADMIN).json()["key"]
        seen = set()
        for path, methods, dependencies in _routes(app.routes):
            seen.add(path)
            if path in PUBLIC:
                continue
            assert dependencies & {"require_key", "require_master", "signed_in"}, f"{path} has no key check"
            if path in ADMIN_ONLY:
                assert "require_master" in dependencies, path
            for method in methods - {"HEAD"}:
                anonymous = httpx.request(method, url + _filled(path), json={}, timeout=30)
                assert anonymous.status_code == 401, (method, path, anonymous.status_code, anonymous.text)
                if path in ADMIN_ONLY:
                    keyed = httpx.request(method, url + _filled(path), json={}, timeout=30,
                                          headers={"Authorization": f"Bearer {key}"})
                    assert keyed.status_code == 401, (method, path, keyed.status_code)
        assert ADMIN_ONLY <= seen and "/v1/files" in seen and "/chat/api/conversations" in seen


def test_a_key_limited_to_one_model_reaches_no_other_through_any_route(tmp_path):
    with gateway(tmp_path) as (url, _, backend):
        key = httpx.post(url + "/key/generate", json={"models": ["gen"]}, headers=ADMIN).json()["key"]
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        chat = {"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = {
            "/v1/chat/completions": chat, "/v1/completions": {"model": "other", "prompt": "hi", "max_tokens": 2},
            "/v1/search": {"model": "gen", "verifier": "other", "question": "1+1?", "max_tokens": 2},
            "/v1/rewards": {"model": "other", "question": "q", "steps": ["s"]},
            "/v1/responses": {"model": "other", "input": "hi", "max_output_tokens": 2},
        }
        for path, body in refused.items():
            answer = client.post(path, json=body)
            assert answer.status_code == 401, (path, answer.status_code, answer.text)
            assert "not allowed to access model" in answer.text, (path, answer.text)
        # Anthropic's routes answer as Anthropic's API does: 403 permission_error (its SDK reads a 401 as a bad key)
        for path, body in {"/v1/messages": {"model": "other", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]},
                           "/v1/messages/count_tokens": {"model": "other",
                                                         "messages": [{"role": "user", "content": "hi"}]}}.items():
            answer = client.post(path, json=body)
            assert answer.status_code == 403, (path, answer.status_code, answer.text)
            assert answer.json()["error"]["type"] == "permission_error", (path, answer.text)
            assert "not allowed to access model" in answer.text, (path, answer.text)
        with pytest.raises(anthropic.PermissionDeniedError):  # (was its AuthenticationError: "check your key")
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0).messages.create(
                model="other", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert client.get("/v1/models/other").status_code == 404
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["gen"]
        assert [m["model_name"] for m in client.get("/model/info").json()["data"]] == ["gen"]
        health = client.get("/health").json()  # (LiteLLM's /health with a key: its models' backends only)
        assert [e["model"] for e in health["healthy_endpoints"] + health["unhealthy_endpoints"]] == ["gen"]
        # a response made on `gen`, continued on `other`: refused too
        first = client.post("/v1/responses", json={"model": "gen", "input": "hi", "max_output_tokens": 2})
        assert first.status_code == 200, first.text
        follow = client.post("/v1/responses", json={"model": "other", "input": "more", "max_output_tokens": 2,
                                                     "previous_response_id": first.json()["id"]})
        assert follow.status_code == 401
        # a batch line naming `other` fails with the same refusal; nothing reaches the backend as `other`
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat}
        uploaded = client.post("/v1/files", files={"file": ("b.jsonl", json.dumps(line).encode())},
                               data={"purpose": "batch"}).json()
        batch = client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"}).json()
        deadline = time.monotonic() + 60
        while batch["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        assert batch["request_counts"]["failed"] == 1, batch
        error = client.get(f"/v1/files/{batch['error_file_id']}/content").text
        assert "model_not_allowed" in error
        assert "other" not in backend.state.models


def test_one_keys_files_batches_and_responses_are_missing_to_another(tmp_path):
    with gateway(tmp_path) as (url, _, _):
        keys = [httpx.post(url + "/key/generate", json={}, headers=ADMIN).json()["key"] for _ in range(2)]
        owner, other = (httpx.Client(base_url=url, headers={"Authorization": f"Bearer {k}"}, timeout=30)
                        for k in keys)
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "gen", "messages": [{"role": "user", "content": "secret"}], "max_tokens": 2}}
        file_id = owner.post("/v1/files", files={"file": ("b.jsonl", json.dumps(line).encode())},
                             data={"purpose": "batch"}).json()["id"]
        batch_id = owner.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"}).json()["id"]
        response_id = owner.post("/v1/responses", json={"model": "gen", "input": "secret",
                                                        "max_output_tokens": 2}).json()["id"]
        for method, path in [("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                             ("DELETE", f"/v1/files/{file_id}"), ("GET", f"/v1/batches/{batch_id}"),
                             ("POST", f"/v1/batches/{batch_id}/cancel"), ("GET", f"/v1/responses/{response_id}"),
                             ("GET", f"/v1/responses/{response_id}/input_items"),
                             ("DELETE", f"/v1/responses/{response_id}"),
                             ("GET", f"/v1/files?after={file_id}"), ("GET", f"/v1/batches?after={batch_id}")]:
            answer = other.request(method, path)
            assert answer.status_code == 404, (method, path, answer.status_code)
        assert other.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).status_code == 404
        continued = other.post("/v1/responses", json={"model": "gen", "input": "what did I say?",
                                                      "max_output_tokens": 2, "previous_response_id": response_id})
        # (OpenAI's 400 previous_response_not_found, as for an id never made: nothing says it exists)
        assert continued.status_code == 400 and "secret" not in continued.text
        assert continued.json()["error"]["code"] == "previous_response_not_found"
        assert other.get("/v1/files").json()["data"] == [] and other.get("/v1/batches").json()["data"] == []
        info = other.get("/key/info", params={"key": keys[0]})
        assert info.status_code == 403
        # the owner's objects are all still there
        assert owner.get(f"/v1/files/{file_id}").status_code == 200
        assert owner.get(f"/v1/responses/{response_id}").status_code == 200


def _raw_post(url: str, path: str, headers: str, timeout: float = 10) -> bytes:
    """The answer's first bytes to a POST whose headers promise a body that never comes."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n"
                     .encode() + b'{"')
        try:
            return sock.recv(4096)
        except TimeoutError:
            return b"(no answer: the gateway waits to read the whole body)"


UPLOAD_HEAD = b'--x\r\nContent-Disposition: form-data; name="file"; filename="b.jsonl"\r\n\r\n'


def _chunks(head: bytes, total: int, piece: int = 1 << 20):
    yield head
    for _ in range(total // piece):
        yield b"a" * piece


@pytest.mark.parametrize("path", ["/key/generate", "/chat/api/login", "/v1/batches", "/v1/files",
                                  "/v1/chat/completions"])
def test_a_body_past_the_limit_is_refused_before_it_is_read_signed_in_or_not(tmp_path, path):
    """FastAPI reads a route's declared body (JSON, a multipart upload) before its key check: without
    a limit at the edge any client could make the gateway hold a body of any size in memory or on disk
    (the admin API's and the sign-in's among them; before, each was read whole, then refused 401). A
    declared length past the limit is a 413 at once, a chunked body is cut off at it."""
    with gateway(tmp_path, chat=True) as (url, _, _):
        answer = _raw_post(url, path, "Content-Length: 10000000000\r\n")
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert b"body_too_large" in answer
        upload = path == "/v1/files"
        headers = {"Content-Type": "multipart/form-data; boundary=x" if upload else "application/json"}
        if path == "/v1/chat/completions":  # (read after the key check: a key holder's body)
            headers["Authorization"] = f"Bearer {MASTER}"
        total = (64 << 20) + (3 << 20) if upload else MAX_BODY_BYTES + (2 << 20)
        cut = httpx.post(url + path, content=_chunks(UPLOAD_HEAD if upload else b'{"user_id": "', total),
                         headers=headers, timeout=60)
        assert cut.status_code == 413 and cut.json()["error"]["code"] == "body_too_large", cut.text
        # what fits goes through as before
        assert httpx.post(url + path, json={}, timeout=30).status_code in (400, 401, 422)


def test_a_password_set_by_the_admin_api_signs_the_user_out_everywhere(tmp_path):
    """As `treeserve gateway users set-password` does: a reset for a stolen account must end the
    thief's session (before, `/user/update` with a password left every session alive)."""
    with gateway(tmp_path, chat=True) as (url, app, _):
        add_user(app, "ada", "correct horse battery")
        browser = httpx.Client(base_url=url, timeout=30)
        signed = browser.post("/chat/api/login", json={"user_id": "ada", "password": "correct horse battery"})
        assert signed.status_code == 200 and browser.get("/chat/api/me").status_code == 200
        budget = httpx.post(url + "/user/update", json={"user_id": "ada", "max_budget": 5}, headers=ADMIN)
        assert budget.status_code == 200 and browser.get("/chat/api/me").status_code == 200  # no password: kept
        reset = httpx.post(url + "/user/update", json={"user_id": "ada", "password": "a brand new one"}, headers=ADMIN)
        assert reset.status_code == 200, reset.text
        assert browser.get("/chat/api/me").status_code == 401
        assert browser.post("/chat/api/login", json={"user_id": "ada", "password": "a brand new one"}).status_code == 200


def test_json_nested_too_deeply_is_a_400_not_a_500(tmp_path):
    """json's C parser recurses once per level: a body (or a batch file's line) of 100,000 `[` was
    an internal error (RecursionError); it is a 400 naming the body, or a batch failed naming its line (as
    OpenAI's validation fails one)."""
    deep = b'{"model": "gen", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with gateway(tmp_path) as (url, _, _):
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {MASTER}"}, timeout=30)
        answer = client.post("/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json", answer.text
        uploaded = client.post("/v1/files", files={"file": ("b.jsonl", deep)}, data={"purpose": "batch"}).json()
        batch = client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})
        assert batch.status_code == 200 and batch.json()["status"] == "failed", batch.text
        assert batch.json()["errors"]["data"][0]["message"] == "line 1 is nested too deeply"


def test_keys_passwords_and_authorization_headers_never_reach_the_log(tmp_path, caplog):
    caplog.set_level("DEBUG")
    with gateway(tmp_path, chat=True) as (url, app, _):
        add_user(app, "ada", "correct horse battery")
        key = httpx.post(url + "/key/generate", json={"key_alias": "ada-key"}, headers=ADMIN).json()["key"]
        secrets = [key, MASTER, "sk-not-a-real-key-123456", "sk-wrong-master-654321", "a wrong password 987",
                   "correct horse battery"]
        httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secrets[2]}"},
                   json={"model": "gen", "messages": [{"role": "user", "content": "hi"}]})
        httpx.get(url + "/key/list", headers={"Authorization": f"Bearer {secrets[3]}"})
        httpx.get(url + "/key/info", params={"key": key}, headers=ADMIN)
        httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "gen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        httpx.post(url + "/chat/api/login", json={"user_id": "ada", "password": secrets[4]})
        httpx.post(url + "/chat/api/login", json={"user_id": "ada", "password": secrets[5]})
    logged = "\n".join(record.getMessage() for record in caplog.records  # (the test's own httpx logs its URLs)
                        if record.name.startswith(("treeserve", "uvicorn", "fastapi", "starlette", "sqlalchemy")))
    assert "refused 401" in logged and "failed chat sign-in" in logged  # (the gateway's log was read)
    for secret in secrets:
        assert secret not in logged
