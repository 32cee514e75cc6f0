"""The gateway in front of a real treeserve server, on SQLite and on PostgreSQL (a throwaway
cluster): keys, errors in OpenAI's schema, billing from the backend's usage (streams too), budgets
and rate limits that hold under concurrency and across two gateways on one database, routing."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from conftest import API_KEY, assert_no_leak, running_server, wait_idle
from gateway_support import wait_for
from treeserve.gateway import pricing
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-master-test"
OUT_PRICE, IN_PRICE = 1e-3, 1e-6
FIXED = {"min_tokens": 8}  # every answer is 8 tokens: costs are known in advance


def _config(database: str, urls: list[str], prices: tuple[float, float] = (IN_PRICE, OUT_PRICE),
            **options) -> GatewayConfig:
    backends = [BackendConfig(url, api_key=API_KEY) for url in urls]
    models = {"tiny": ModelConfig("tiny", backends, input_cost_per_token=prices[0], output_cost_per_token=prices[1],
                                  max_tokens=64),
              "other": ModelConfig("other", [BackendConfig(urls[0], api_key=API_KEY, model="tiny")])}
    return GatewayConfig(models=models, master_key=MASTER, database=database, **({"health_interval": 0.2} | options))


@contextlib.contextmanager
def gateway(database: str, urls: list[str], **options):
    app = build_app(_config(database, urls, **options))
    with running_server(app) as url:
        yield url, app


def _admin(url: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {MASTER}"}, timeout=30, **kwargs)


def _new_key(url: str, **limits) -> str:
    response = _admin(url, "POST", "/key/generate", json=limits)
    assert response.status_code == 200, response.text
    return response.json()["key"]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client, content="Hello", **extra):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=8, extra_body=FIXED | extra.pop("extra_body", {}), **extra)


def test_admin_routes_need_the_master_key(server, database):
    with gateway(database, [server.url]) as (url, _):
        for method, path in [("POST", "/key/generate"), ("GET", "/key/list"), ("POST", "/user/new"),
                             ("POST", "/user/update"), ("POST", "/user/delete"), ("GET", "/user/list"),
                             ("GET", "/spend/logs"), ("GET", "/metrics"), ("GET", "/health/backends")]:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                response = httpx.request(method, url + path, headers=headers, json={})
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
        key = _new_key(url)
        assert httpx.get(url + "/key/list", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200


def test_users_are_updated_listed_and_deleted_with_their_keys_and_spend_can_start_again(server, database):
    """LiteLLM's /user/update, /user/list, /user/delete (with the user's keys) and `spend` in
    /key/update and /user/update (0: the budget starts again); a helper found them missing."""
    with gateway(database, [server.url]) as (url, _):
        assert _admin(url, "POST", "/user/new", json={"user_id": "ann", "max_budget": 1e-9}).status_code == 200
        key = _new_key(url, user_id="ann")
        client = _client(url, key)
        _chat(client)
        with pytest.raises(openai.APIStatusError) as refused:  # (the user's budget is spent)
            _chat(client)
        # (LiteLLM's proxy's answer: 429 `budget_exceeded`; not to be retried while it is spent)
        assert refused.value.status_code == 429 and refused.value.body["code"] == "budget_exceeded"
        assert refused.value.body["type"] == "budget_exceeded"
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert refused.value.body["message"].startswith("max_budget: Budget has been exceeded!")
        updated = _admin(url, "POST", "/user/update", json={"user_id": "ann", "max_budget": 5.0, "spend": 0,
                                                              "budget_duration": "1mo", "metadata": {"team": "x"}})
        assert updated.status_code == 200, updated.text
        info = updated.json()["user_info"]
        assert (info["max_budget"], info["spend"], info["budget_duration"], info["metadata"]) == (5.0, 0.0, "1mo",
                                                                                                  {"team": "x"})
        assert info["budget_reset_at"] and _chat(client).usage.completion_tokens == 8
        # (a request's spend is written after its answer is sent: the reset below must come after it)
        assert wait_for(lambda: _admin(url, "GET", "/key/info", params={"key": key}).json()["info"]["spend"] > 0)
        kept = _admin(url, "POST", "/user/update", json={"user_id": "ann", "models": ["tiny"]}).json()["user_info"]
        assert kept["metadata"] == {"team": "x"} and kept["max_budget"] == 5.0  # (only what is given changes)
        key_spend = _admin(url, "POST", "/key/update", json={"key": key, "spend": 0}).json()
        assert key_spend["spend"] == 0.0
        for null in ("spend", "blocked"):  # (they were a 500: the columns take no NULL)
            assert _admin(url, "POST", "/key/update", json={"key": key, null: None}).status_code == 400
        for bad in ({"user_id": "nobody", "max_budget": 1}, {"user_id": "ann", "spend": -1},
                    {"user_id": "ann", "budget_duration": "monthly"}, {"user_id": "ann", "nope": 1}):
            answer = _admin(url, "POST", "/user/update", json=bad)
            assert answer.status_code in (400, 404), (bad, answer.text)
        assert _admin(url, "POST", "/user/new", json={"user_id": "bob"}).status_code == 200
        assert [u["user_id"] for u in _admin(url, "GET", "/user/list").json()["users"]] == ["ann", "bob"]
        assert _admin(url, "POST", "/user/delete", json={"user_ids": ["ann", "nobody"]}).status_code == 404
        assert _admin(url, "POST", "/user/delete", json={"user_ids": ["ann"]}).json() == 1  # (LiteLLM's count)
        assert [u["user_id"] for u in _admin(url, "GET", "/user/list").json()["users"]] == ["bob"]
        assert _admin(url, "GET", "/key/info", params={"key": key}).status_code == 404  # (its keys went with it)
        with pytest.raises(openai.AuthenticationError):  # (this process forgot it at once)
            _chat(client)


def test_litellms_key_routes_and_unique_aliases(server, database, caplog):
    """What an operator moving from LiteLLM's proxy reaches for (a helper's audit): /key/block,
    /key/unblock, /key/regenerate (a new secret, the same key: its spend stays), /key/info on a key
    by itself, /model/info, /health/liveliness and /health/readiness, unique key aliases, spend logs
    found by request id and naming their key's hash, and refusals logged with an x-request-id."""
    with gateway(database, [server.url]) as (url, _):
        created = _admin(url, "POST", "/key/generate", json={"key_alias": "team-a", "models": ["tiny"]}).json()
        key = created["key"]
        for alias in ("team-a", "master"):
            taken = _admin(url, "POST", "/key/generate", json={"key_alias": alias})
            assert taken.status_code == 400 and taken.json()["error"]["code"] == "key_alias_exists", taken.text
        other = _new_key(url, key_alias="team-b")
        assert _admin(url, "POST", "/key/update", json={"key": other, "key_alias": "team-a"}).status_code == 400
        assert _admin(url, "POST", "/key/update", json={"key": key, "key_alias": "team-a"}).status_code == 200
        answer = _chat(_client(url, key))
        own = httpx.get(url + "/key/info", headers={"Authorization": f"Bearer {key}"}).json()
        assert own["info"]["key_alias"] == "team-a" and own["info"]["key_id"] == created["key_id"]
        assert httpx.get(url + "/key/info", params={"key": other},
                         headers={"Authorization": f"Bearer {key}"}).status_code == 403
        assert _admin(url, "GET", "/key/info", params={"key": key}).json()["key"] == key
        assert _admin(url, "POST", "/key/block", json={"key": key}).json()["blocked"] is True
        with pytest.raises(openai.AuthenticationError):
            _chat(_client(url, key))
        assert _admin(url, "POST", "/key/unblock", json={"key": created["token"]}).json()["blocked"] is False
        renewed = _admin(url, "POST", "/key/regenerate", json={"key": key}).json()
        assert renewed["key"] != key and renewed["key_id"] == created["key_id"] and renewed["spend"] > 0
        with pytest.raises(openai.AuthenticationError):
            _chat(_client(url, key))
        assert _chat(_client(url, renewed["key"])).usage.completion_tokens == 8
        logs = _admin(url, "GET", "/spend/logs", params={"request_id": answer._request_id}).json()
        assert [r["request_id"] for r in logs] == [answer._request_id] and logs[0]["api_key"] == renewed["token"]
        newest = _admin(url, "GET", "/spend/logs", params={"order": "desc", "limit": 1}).json()
        assert newest[0]["request_id"] != answer._request_id
        info = httpx.get(url + "/model/info", headers={"Authorization": f"Bearer {renewed['key']}"}).json()
        assert [m["model_name"] for m in info["data"]] == ["tiny"]  # (the key's models only)
        assert info["data"][0]["model_info"]["output_cost_per_token"] == OUT_PRICE
        for probe in ("/health/liveliness", "/health/readiness"):
            assert httpx.get(url + probe).status_code == 200
        with caplog.at_level(logging.INFO, logger="treeserve.gateway"):
            with pytest.raises(openai.AuthenticationError) as refused:  # (LiteLLM's proxy's 401)
                _client(url, renewed["key"]).chat.completions.create(model="other", max_tokens=2,
                                                                     messages=[{"role": "user", "content": "x"}])
        assert refused.value.body["type"] == "key_model_access_denied" and refused.value.body["param"] == "model"
        assert "can only access models=['tiny']. Tried to access other" in refused.value.body["message"]
        request_id = refused.value.response.headers["x-request-id"]
        assert any(request_id in r.getMessage() and "refused 401" in r.getMessage() for r in caplog.records)


def test_keys_are_stored_hashed_and_shown_once(server, database):
    with gateway(database, [server.url]) as (url, app):
        created = _admin(url, "POST", "/key/generate", json={"key_alias": "team-a", "models": ["tiny"],
                                                              "metadata": {"team": "a"}}).json()
        key = created["key"]
        assert key.startswith("sk-") and created["token"] != key and created["key_name"].endswith(key[-4:])
        listed = _admin(url, "GET", "/key/list").json()["keys"]
        assert key not in str(listed) and created["token"] in str(listed)
        for by in (key, created["token"]):
            info = _admin(url, "GET", "/key/info", params={"key": by}).json()["info"]
            assert info["key_alias"] == "team-a" and info["metadata"] == {"team": "a"}
        with create_engine(app.state.config.database).connect() as conn:
            dumped = str(conn.execute(text("SELECT * FROM api_keys")).all())
        assert key not in dumped and key[3:] not in dumped and created["token"] in dumped
        assert _admin(url, "GET", "/key/info", params={"key": "sk-nope"}).status_code == 404


def test_the_openai_client_is_served_and_billed_from_the_backends_usage(server, database):
    with gateway(database, [server.url]) as (url, app):
        key = _new_key(url, models=["tiny"])
        client = _client(url, key)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        answer = _chat(client)
        assert answer.choices[0].message.content and answer.usage.completion_tokens == 8
        completion = client.completions.create(model="tiny", prompt="The water is", max_tokens=8, extra_body=FIXED)
        chunks = list(_chat(client, "Stream it", stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed and chunks[-1].usage is not None and not chunks[-1].choices
        assert all(c.usage is None for c in chunks[:-1]), "usage in every chunk was not asked for"
        plain = list(_chat(client, "No usage", stream=True))
        assert all(c.usage is None for c in plain) and all(c.choices for c in plain)
        got = [answer.usage, completion.usage, chunks[-1].usage]
        logs = wait_for(lambda: (rows := _admin(url, "GET", "/spend/logs", params={"api_key": key}).json())
                        and len(rows) == 4 and rows)
        assert [(r["prompt_tokens"], r["completion_tokens"]) for r in logs[:3]] == \
            [(u.prompt_tokens, u.completion_tokens) for u in got]
        assert logs[3]["completion_tokens"] == 8 and logs[3]["prompt_tokens"] > 0 and logs[3]["stream"]
        assert {r["status"] for r in logs} == {"success"} and {r["backend"] for r in logs} == {server.url}
        for row, usage in zip(logs, got):
            assert row["cost"] == pytest.approx(usage.prompt_tokens * IN_PRICE + usage.completion_tokens * OUT_PRICE)
        info = _admin(url, "GET", "/key/info", params={"key": key}).json()["info"]
        assert info["spend"] == pytest.approx(sum(r["cost"] for r in logs))
        daily = _admin(url, "GET", "/spend/daily").json()
        assert sum(d["requests"] for d in daily) == 4
        csv_text = _admin(url, "GET", "/spend/logs", params={"api_key": key, "format": "csv"}).text
        assert csv_text.splitlines()[0].startswith("request_id,") and len(csv_text.splitlines()) == 5


def test_refusals_are_openai_errors(server, database):
    with gateway(database, [server.url]) as (url, _):
        with pytest.raises(openai.AuthenticationError):
            _chat(_client(url, "sk-unknown"))
        limited = _client(url, _new_key(url, models=["other"]))
        with pytest.raises(openai.AuthenticationError) as denied:  # (LiteLLM's proxy's 401 for a model not the key's)
            _chat(limited)
        assert denied.value.body["param"] == "model" and denied.value.body["type"] == "key_model_access_denied"
        with pytest.raises(openai.NotFoundError):
            limited.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
        _inside_one_minute()
        rpm = _client(url, _new_key(url, rpm_limit=2))
        _chat(rpm), _chat(rpm)
        with pytest.raises(openai.RateLimitError) as limited_rate:
            _chat(rpm)
        assert 1 <= int(limited_rate.value.response.headers["retry-after"]) <= 60
        assert limited_rate.value.body["param"] == "rpm_limit"
        broke = _client(url, _new_key(url, max_budget=0.0))
        with pytest.raises(openai.RateLimitError) as over:
            _chat(broke)
        assert over.value.body["code"] == "budget_exceeded" and "max_budget" in over.value.body["message"]
        assert over.value.body["type"] == "budget_exceeded" and "retry-after" not in over.value.response.headers
        expired = _new_key(url, duration="1s")
        wait_for(lambda: httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {expired}"},
                                    json={}).status_code == 401, timeout=5)
        with pytest.raises(openai.AuthenticationError):
            _chat(_client(url, expired))
        bad = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {MASTER}"},
                         content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        search = httpx.post(url + "/v1/search", headers={"Authorization": f"Bearer {limited.api_key}"},
                            json={"model": "other", "verifier": "tiny", "question": "1 + 1?"})
        assert search.status_code == 401 and search.json()["error"]["param"] == "verifier"
        assert search.json()["error"]["type"] == "key_model_access_denied"
        period = _admin(url, "POST", "/key/generate", json={"budget_duration": "monthly"})
        assert period.status_code == 400 and period.json()["error"]["param"] == "budget_duration"


def _inside_one_minute(seconds: float = 15) -> None:
    """rpm windows are calendar minutes: a burst counted against one must not straddle two."""
    import time

    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.1)


def _burst(urls: list[str], key: str, count: int) -> list[object]:
    def one(i):
        try:
            return _chat(_client(urls[i % len(urls)], key), f"Question {i}")
        except openai.APIStatusError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _key_row(database: str, key_name: str) -> dict:
    with create_engine(database).connect() as conn:
        return dict(conn.execute(text("SELECT spend, reserved, in_flight FROM api_keys WHERE key_name = :n"),
                                 {"n": key_name}).mappings().one())


@pytest.mark.parametrize("gateways", [1, 2])
def test_a_budget_holds_under_a_burst(server, database, gateways):
    """20 concurrent requests on a key whose budget covers 5: spend ends at most one request's worst
    case above the budget (with two gateways on one database too)."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(gateway(database, [server.url]))[0] for _ in range(gateways)]
        worst = 64 * OUT_PRICE + 0.001  # max_tokens 64 at the output price, plus a generous prompt bound
        created = _admin(urls[0], "POST", "/key/generate", json={"max_budget": 5 * 8 * OUT_PRICE}).json()
        results = _burst(urls, created["key"], 20)
        served = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert served and refused, (len(served), [str(r) for r in refused][:3])
        # 429s: spent, not to be retried; held by the burst's requests in flight (their worst cases), to try again
        assert all(r.body["code"] == "budget_exceeded" and r.status_code == 429 and (
            r.response.headers.get("x-should-retry") == "false" or (
                r.response.headers["retry-after"] == "1" and "held" in r.body["message"]))
            for r in refused), [(r.status_code, r.body) for r in refused]
        row = wait_for(lambda: (r := _key_row(database, created["key_name"])) and r["in_flight"] == 0
                       and abs(r["reserved"]) < 1e-9 and r)
        assert row["spend"] == pytest.approx(sum(8 * OUT_PRICE + r.usage.prompt_tokens * IN_PRICE for r in served))
        assert row["spend"] <= 5 * 8 * OUT_PRICE + worst


def _slow_backend(seconds: float):
    """A backend whose chat answers (8 tokens) take `seconds`."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        await asyncio.sleep(seconds)
        return {"id": "chatcmpl-slow", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}}
    return app


def test_a_budget_held_by_a_request_in_flight_is_a_429_to_retry_not_a_400(database):
    """A key whose budget is held by the worst case of a request in flight: the next is refused
    with 429 and Retry-After (the hold comes back at the answer), not the 400 of a spent
    budget, which the OpenAI client does not retry (a helper's finding); afterwards it is served."""
    with running_server(_slow_backend(2.0)) as backend, gateway(database, [backend]) as (url, app):
        worst = pricing.worst_cost({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64},
                                   app.state.config.models["tiny"])
        client = _client(url, _new_key(url, max_budget=0.5 * worst))  # (held while any of it is left)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (it holds 64 tokens' worth, and costs 8)
            slow = pool.submit(client.chat.completions.create, model="tiny", max_tokens=64,
                               messages=[{"role": "user", "content": "Hello"}])
            time.sleep(0.5)
            with pytest.raises(openai.RateLimitError) as held:
                _chat(client)
            assert slow.result().usage.completion_tokens == 8
        assert held.value.body["code"] == "budget_exceeded" and held.value.response.headers["retry-after"] == "1"
        assert "spent 0.000000" in held.value.body["message"]
        assert _chat(client).usage.completion_tokens == 8


# The prompt dearer than the answer: a short message's worst case (its UTF-8 bytes plus 16 template
# tokens) is several times what its few real prompt tokens cost, as a large max_tokens would be.
PROMPT_PRICES = (1e-3, 1e-4)


def _cost_of(usage, prices=PROMPT_PRICES) -> float:
    return usage.prompt_tokens * prices[0] + usage.completion_tokens * prices[1]


def test_a_key_used_back_to_back_is_refused_only_when_its_budget_is_spent(server, database):
    """A client that sends each request as the last one is answered: every request its budget pays
    for passes (its last answer's hold is cut to the real cost at once, not at the settlement's
    batch), the next is refused; 8 costs summed in floating point must not let a 9th in."""
    with gateway(database, [server.url], prices=PROMPT_PRICES) as (url, app):
        probe = _chat(_client(url, _new_key(url)))  # what each identical request costs
        cost = _cost_of(probe.usage)
        worst = pricing.worst_cost({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
                                   app.state.config.models["tiny"])
        assert worst > 4 * cost, (worst, cost)  # held as its worst case, the first answer would block the third
        client = _client(url, _new_key(url, max_budget=8 * cost))
        for i in range(8):
            try:
                answer = _chat(client)
            except openai.RateLimitError as exc:
                pytest.fail(f"request {i + 1} of the 8 the budget pays for was refused: {exc.body['message']}")
            assert answer.usage.model_dump() == probe.usage.model_dump()
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(client)
        assert refused.value.body["code"] == "budget_exceeded"
        info = _admin(url, "GET", "/key/info", params={"key": client.api_key}).json()["info"]
        assert info["spend"] == pytest.approx(8 * cost) and info["reserved"] == 0.0


def test_a_hold_is_cut_to_the_real_cost_when_the_answer_ends(server, database):
    """Right after an answer (whole or streamed) returns, its key and user hold its real cost (or
    nothing, once settled), never its worst case; the settlement moves exactly that to spend."""
    with gateway(database, [server.url], prices=PROMPT_PRICES) as (url, app):
        key = _new_key(url, max_budget=10.0, user_id="held")
        client, accounts, ledger = _client(url, key), app.state.store.accounts, app.state.store.ledger
        answer = _chat(client)
        held = [accounts.key_info(key)["reserved"], accounts.user_info("held")["user_info"]["reserved"]]
        cost = _cost_of(answer.usage)
        assert all(h == pytest.approx(cost) or h == pytest.approx(0, abs=1e-12) for h in held), (held, cost)
        ledger.flush()
        chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
        streamed = _cost_of(chunks[-1].usage)
        reserved = accounts.key_info(key)["reserved"]
        assert reserved == pytest.approx(streamed) or reserved == pytest.approx(0, abs=1e-12), (reserved, streamed)
        info = _admin(url, "GET", "/key/info", params={"key": key}).json()["info"]  # (settlements flushed)
        assert info["reserved"] == 0.0 and info["spend"] == pytest.approx(cost + streamed)
        user = _admin(url, "GET", "/user/info", params={"user_id": "held"}).json()["user_info"]
        assert user["reserved"] == 0.0 and user["spend"] == pytest.approx(cost + streamed)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on forever"}], "max_tokens": 400,
                              "ignore_eos": True, "n": 16}),
    ("/v1/completions", {"prompt": "Go on forever", "max_tokens": 400, "ignore_eos": True, "n": 16}),
])
def test_a_client_that_leaves_before_its_whole_answer_stops_its_backend_and_pays_nothing(server, tmp_path, path,
                                                                                          body):
    """The gateway's client hangs up on a non-streamed request: the backend's request is aborted (the
    gateway closes its upstream), the request is logged as closed by its client at no cost, and its
    key's slot is free at once. Before, the backend ran it to its end, the key held its slot meanwhile
    (its next request refused by max_parallel_requests) and paid for the whole answer."""
    aborted = []
    original_abort = server.async_engine.abort
    server.async_engine.abort = lambda request_id: (aborted.append(request_id), original_abort(request_id))
    models = {"tiny": ModelConfig("tiny", [BackendConfig(server.url, api_key=API_KEY)],
                                  input_cost_per_token=IN_PRICE, output_cost_per_token=OUT_PRICE)}
    config = GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gateway.db'}")
    try:
        with running_server(build_app(config)) as url:
            key = _new_key(url, max_parallel_requests=1)
            _hang_up_once_running(url, path, {"model": "tiny"} | body, key, server.engine)
            assert wait_for(lambda: aborted, timeout=20), "the backend's request was not aborted"
            logs = wait_for(lambda: (rows := _admin(url, "GET", "/spend/logs", params={"api_key": key}).json())
                            and rows, timeout=20)
            assert [(r["status"], r["cost"]) for r in logs] == [("client_closed", 0.0)], logs
            assert _client(url, key).chat.completions.create(  # its slot was given back
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
    finally:
        server.async_engine.abort = original_abort
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def _hang_up_once_running(url: str, path: str, body: dict, key: str, engine) -> None:
    """Sends a non-streamed request and closes the connection once the backend's engine runs it (a
    read timeout could end it before the gateway had sent it on: then nothing runs to be aborted)."""
    import socket
    from urllib.parse import urlsplit

    payload = json.dumps(body).encode()
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert wait_for(engine.scheduler.has_unfinished, timeout=30, interval=0.01), "the backend never ran it"


def test_budgets_without_prices_are_warned_about(server, tmp_path, caplog):
    """Without prices every request costs 0 and max_budget never acts: a budget set through the
    admin API is answered with a warning, and a gateway starting on a database with budgeted keys
    logs one; a gateway with prices does neither."""
    database = f"sqlite:///{tmp_path / 'gateway.db'}"
    caplog.set_level(logging.WARNING, logger="treeserve.gateway")
    with gateway(database, [server.url], prices=(0.0, 0.0)) as (url, _):
        created = _admin(url, "POST", "/key/generate", json={"max_budget": 5.0}).json()
        assert "no model has a price" in created["warning"] and "max_budget never refuses" in created["warning"]
        assert "warning" not in _admin(url, "POST", "/key/generate", json={}).json()
        user = _admin(url, "POST", "/user/new", json={"user_id": "ann", "max_budget": 1.0}).json()
        assert "no model has a price" in user["warning"]
    assert created["warning"] in caplog.text
    caplog.clear()
    with gateway(database, [server.url], prices=(0.0, 0.0)):
        pass
    assert "1 key(s) and 1 user(s) have a max_budget, but no model has a price" in caplog.text
    caplog.clear()
    with gateway(database, [server.url]) as (url, _):
        assert "warning" not in _admin(url, "POST", "/key/generate", json={"max_budget": 5.0}).json()
    assert "no model has a price" not in caplog.text


def test_rate_and_parallel_limits_hold_across_two_gateways(server, database):
    with gateway(database, [server.url]) as (first, _), gateway(database, [server.url]) as (second, _):
        _inside_one_minute()
        key = _new_key(first, rpm_limit=4)
        results = _burst([first, second], key, 10)
        assert sum(not isinstance(r, Exception) for r in results) == 4
        assert all(r.status_code == 429 for r in results if isinstance(r, Exception))
        parallel = _new_key(first, max_parallel_requests=2)
        results = _burst([first, second], parallel, 12)
        refused = [r for r in results if isinstance(r, Exception)]
        assert refused and all(r.status_code == 429 and r.body["param"] == "max_parallel_requests" for r in refused)
        name = _admin(first, "GET", "/key/info", params={"key": parallel}).json()["info"]["key_name"]
        assert _key_row(database, name)["in_flight"] == 0  # given back as each request ended
        one_at_a_time = _client(first, _new_key(first, max_parallel_requests=1))
        for i in range(5):  # each next request as soon as the last one ended: never refused
            _chat(one_at_a_time, f"Next {i}")
        _inside_one_minute()
        tokens = _new_key(first, tpm_limit=100, soft_budget=0.5)  # each request may use ~70 (prompt bytes, max_tokens)
        assert _admin(first, "GET", "/key/info", params={"key": tokens}).json()["info"]["soft_budget"] == 0.5
        results = _burst([first, second], tokens, 8)
        used = [r.usage.total_tokens for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert used and refused and all(r.status_code == 429 and r.body["param"] == "tpm_limit" for r in refused)
        assert sum(used) < 100 + max(used)  # (admitted before the first settled, all 8 were: ~5x over)


def test_a_dead_replica_is_retried_around_then_cut_off_by_its_breaker(server, database):
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    with gateway(database, [dead, server.url], routing="round_robin", breaker_failures=2, breaker_cooldown=60,
                 health_interval=0) as (url, app):
        client = _client(url, _new_key(url))
        for i in range(6):
            assert _chat(client, f"Try {i}").usage.completion_tokens == 8
        backends = {b["url"]: b for b in _admin(url, "GET", "/health/backends").json() if b["model"] == "tiny"}
        assert backends[dead]["circuit"] == "open" and "Connect" in backends[dead]["last_error"]
        assert backends[server.url]["circuit"] == "closed"
        metrics = _admin(url, "GET", "/metrics").text
        failures = [line for line in metrics.splitlines()
                    if line.startswith(f'treeserve_gateway:backend_failures_total{{backend="{dead}"')]
        assert failures and float(failures[0].split()[-1]) == 2.0, failures  # then the breaker kept it out
        logs = _admin(url, "GET", "/spend/logs").json()
        assert {r["backend"] for r in logs} == {server.url} and len(logs) == 6


def test_health_checks_mark_a_dead_replica_down(server, database):
    dead = "http://127.0.0.1:9"
    with gateway(database, [dead, server.url], health_interval=0.1) as (url, _):
        assert wait_for(lambda: [b["healthy"] for b in _admin(url, "GET", "/health/backends").json()
                                 if b["model"] == "tiny"] == [False, True])
        metrics = _admin(url, "GET", "/metrics").text
        assert f'treeserve_gateway:backend_up{{backend="{dead}"}} 0.0' in metrics
        assert f'treeserve_gateway:backend_up{{backend="{server.url}"}} 1.0' in metrics
        client = _client(url, _new_key(url))
        assert _chat(client).usage.completion_tokens == 8


@pytest.fixture(scope="module")
def second_server(llama_dir):
    """A second real server of the same model: the other replica."""
    from treeserve.server.launch import build_app as build_server

    app = build_server(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                       kv_cache_memory_bytes=16 << 20, max_model_len=512)
    with running_server(app) as url:
        yield url, app
    app.state.engine.shutdown()


def _served(app) -> float:
    """Sequences a server has finished (its own count, not the gateway's)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(app.state.metrics.render().decode())
               for sample in family.samples if sample.name == "treeserve:request_success_total")


def test_affinity_keeps_a_user_on_one_replica(server, second_server, database):
    """Two real replicas: each user's requests all go to one of them, the users are spread over
    both (a router that always took the first would fail), and each replica's own request count is
    what the spend logs say it served. (Which replica a user hashes to depends on the replicas' random
    ports: 8 users all landed on one for 1 port pair in 128; 16 users, for 1 in 32,768.)"""
    users = [f"user-{i}" for i in range(16)]
    replicas = [server.url, second_server[0]]
    before = [_served(server.app), _served(second_server[1])]
    with gateway(database, replicas, routing="affinity") as (url, _):
        client = _client(url, _new_key(url))
        for user in users:
            for _ in range(3):
                _chat(client, "Hi", user=user)
        logs = _admin(url, "GET", "/spend/logs").json()
    by_user = {}
    for i, row in enumerate(logs):
        by_user.setdefault(users[i // 3], set()).add(row["backend"])
    assert all(len(backends) == 1 for backends in by_user.values()), by_user
    assert set.union(*by_user.values()) == set(replicas), by_user
    counts = [sum(row["backend"] == r for row in logs) for r in replicas]
    assert [_served(server.app) - before[0], _served(second_server[1]) - before[1]] == counts


def test_a_client_that_leaves_a_stream_aborts_it_upstream_and_pays_for_what_it_got(server, database):
    from conftest import assert_no_leak, wait_idle

    with gateway(database, [server.url]) as (url, _):
        key = _new_key(url)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 400,
                "stream": True, "min_tokens": 400, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}}
        seen = None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as response:
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                usage = json.loads(line[6:]).get("usage") if line.startswith("data: {") else None
                if usage:  # (the opening chunk, the role's, reports none)
                    seen = usage["completion_tokens"]
                    if seen >= 3:
                        break
        wait_idle(server.engine, timeout=10)
        assert not server.engine.scheduler.has_unfinished(), "the backend went on generating"
        assert_no_leak(server.engine)
        row = wait_for(lambda: [r for r in _admin(url, "GET", "/spend/logs", params={"api_key": key}).json()
                                if r["request_id"] == request_id])
        assert row[0]["status"] == "client_closed"
        assert seen <= row[0]["completion_tokens"] < 400  # what was relayed (a chunk in flight may count)


def test_budgets_and_rate_limits_hold_across_two_gateway_processes(server, database):
    """The same as the burst tests above with two real `treeserve gateway` processes on one database."""
    from gateway_support import gateway_processes

    with gateway_processes(2, database, server.url, API_KEY, MASTER, OUT_PRICE) as urls:
        created = _admin(urls[0], "POST", "/key/generate", json={"max_budget": 5 * 8 * OUT_PRICE}).json()
        results = _burst(urls, created["key"], 20)
        served = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        # spent: not to be retried; held by the burst's requests in flight: to try again (as in the burst test above)
        assert served and all(r.body["code"] == "budget_exceeded" and r.status_code == 429 and (
            r.response.headers.get("x-should-retry") == "false" or r.response.headers["retry-after"] == "1")
            for r in refused), \
            [(r.status_code, r.body) for r in refused]
        worst = 64 * OUT_PRICE  # max_tokens 64 (the input price is 0 here)
        row = wait_for(lambda: (r := _key_row(database, created["key_name"])) and r["in_flight"] == 0
                       and abs(r["reserved"]) < 1e-9 and r, timeout=20)
        assert row["spend"] == pytest.approx(len(served) * 8 * OUT_PRICE)
        assert row["spend"] <= 5 * 8 * OUT_PRICE + worst
        _inside_one_minute()
        limited = _new_key(urls[1], rpm_limit=4)
        assert sum(not isinstance(r, Exception) for r in _burst(urls, limited, 10)) == 4
