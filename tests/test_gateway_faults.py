"""The gateway in front of backends that misbehave (a small fake backend whose URL's first path
segment says how): fallbacks past a model's retries, throttling passed on, answers that are not
JSON, malformed usage, streams without [DONE], a backend setting aiohttp refuses."""
from __future__ import annotations

import contextlib
import json
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from conftest import running_server
from gateway_support import wait_for
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-master-faults"
USAGE = {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


def _answer(usage) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": usage}


def _chunk(text: str, usage) -> bytes:
    event = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}], "usage": usage}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def fault_backend():
    """Answers by the mode its URL names: ok, 503, 429 (Retry-After: 7), 400 (a refusal), text (a 200
    that is not JSON), badusage and listusage (malformed usage), nodone (a stream without [DONE]),
    llamacpp (as ok, its /tokenize answering llama.cpp's `tokens` without a count)."""
    app = FastAPI()
    app.state.calls, app.state.queries = [], []

    @app.get("/{mode}/health")
    def health(mode: str):
        return {"status": "ok"}

    @app.post("/{mode}/tokenize")
    def tokenize(mode: str):  # (llama.cpp's shape: its tokens, no count; the others have no /tokenize)
        if mode != "llamacpp":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"tokens": [1, 2, 3]}

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str, request: Request):
        body = await request.json()
        app.state.calls.append(mode)
        app.state.queries.append(request.url.query)
        if mode in ("503", "429", "400"):
            return JSONResponse({"error": {"message": f"busy {mode}", "type": "x", "param": None, "code": None}},
                                status_code=int(mode), headers={"Retry-After": "7"} if mode == "429" else None)
        if mode == "text":
            return PlainTextResponse("upstream proxy says hello")
        usage = {"badusage": {"prompt_tokens": "abc", "completion_tokens": 8}, "listusage": [1, 2]}.get(mode, USAGE)
        if not body.get("stream"):
            return _answer(usage)

        async def events():
            for i in range(3):
                yield _chunk(f"t{i}", dict(USAGE, completion_tokens=i + 1) if mode != "badusage" else usage)
            if mode != "nodone":
                yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


@pytest.fixture(scope="module")
def backend():
    app = fault_backend()
    with running_server(app) as url:
        yield url, app


@contextlib.contextmanager
def gateway(tmp_path, models: dict[str, list[str]], fallbacks: dict[str, list[str]] | None = None, **options):
    configs = {name: ModelConfig(name, [BackendConfig(url) for url in urls], output_cost_per_token=1e-3,
                                 fallbacks=(fallbacks or {}).get(name, [])) for name, urls in models.items()}
    config = GatewayConfig(models=configs, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}",
                           **({"health_interval": 0} | options))
    app = build_app(config)
    with running_server(app) as url:
        yield url, app


def _post(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {MASTER}"}, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def _spend_row(app, request_id: str) -> dict:
    def settled():
        app.state.store.ledger.flush()
        return next((r for r in app.state.store.ledger.spend_logs(limit=100) if r["request_id"] == request_id), None)
    return wait_for(settled, timeout=10)


def test_fallbacks_are_tried_when_a_model_has_more_replicas_than_retries(backend, tmp_path):
    url, fake = backend
    with gateway(tmp_path, {"m": [f"{url}/503"] * 3, "spare": [f"{url}/ok"]}, {"m": ["spare"]},
                 retries=1, breaker_failures=100) as (gw, app):
        fake.state.calls.clear()
        answer = _post(gw, "m")
        assert answer.status_code == 200, answer.text
        assert fake.state.calls == ["503", "503", "ok"]  # 1 + retries of m's replicas, then the fallback's
        assert _spend_row(app, answer.headers["x-request-id"])["model"] == "spare"


def test_a_lone_backends_429_is_passed_on_with_its_retry_after(backend, tmp_path):
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/429"]}) as (gw, _):
        for stream in (False, True):
            answer = _post(gw, "m", stream=stream)
            assert answer.status_code == 429, answer.text
            assert answer.headers["retry-after"] == "7" and answer.json()["error"]["message"] == "busy 429"
    with gateway(tmp_path, {"m": [f"{url}/429", f"{url}/503"]}, retries=1, routing="round_robin") as (gw, _):
        assert _post(gw, "m").status_code == 503  # not all throttled: no backend could answer


def test_a_200_that_is_not_json_is_a_502_counted_against_the_backend_and_not_billed(backend, tmp_path):
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/text"]}) as (gw, app):
        answer = _post(gw, "m")
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "backend_invalid_response"
        assert answer.json()["error"]["type"] == "bad_gateway"
        assert app.state.router.groups["m"].backends[0].breaker.consecutive == 1
        row = _spend_row(app, answer.headers["x-request-id"])
        assert row["status"] == "error" and row["cost"] == 0 and row["completion_tokens"] == 0


def _observed(app, model: str) -> tuple[float, float]:
    """(requests_total, request_duration_seconds' count) of a model, from the gateway's registry."""
    metrics = app.state.metrics
    counted = sum(s.value for m in metrics.requests.collect() for s in m.samples
                  if s.name.endswith("_total") and s.labels["model"] == model)
    timed = sum(s.value for m in metrics.latency.collect() for s in m.samples
                if s.name.endswith("_count") and s.labels["model"] == model)
    return counted, timed


@pytest.mark.parametrize(("mode", "stream", "status"), [("429", False, 429), ("503", False, 503), ("503", True, 503),
                                                        ("text", False, 502), ("400", True, 400),
                                                        ("400", False, 400)])
def test_every_answer_the_gateway_counts_is_timed_its_own_refusals_and_error_answers_too(backend, tmp_path, mode,
                                                                                         stream, status):
    # (its 429s, 502s and 503s and a streamed error answer were in requests_total but not in the
    # request duration histogram, whose count then fell short of the requests it said it answered)
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/{mode}"]}) as (gw, app):
        assert _post(gw, "m", stream=stream).status_code == status
        assert _observed(app, "m") == (1, 1)


def test_a_request_the_gateway_refuses_itself_is_counted_and_timed(backend, tmp_path):
    """A key's rate limit (the gateway's own 429, no backend asked) is a request answered: it was in
    neither requests_total nor the request duration histogram. A model no one configured is no
    label (a client could make any number of series)."""
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/ok"]}) as (gw, app):
        made = httpx.post(gw + "/key/generate", headers={"Authorization": f"Bearer {MASTER}"}, json={"rpm_limit": 1})
        key = made.json()["key"]
        answers = [httpx.post(gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
                   for model in ("m", "m", "unknown", ["m"])]
        assert [a.status_code for a in answers] == [200, 429, 404, 400]
        assert _observed(app, "m") == (2, 2)
        refused = [s for m in app.state.metrics.requests.collect() for s in m.samples if s.name.endswith("_total")]
        assert [(s.labels["model"], s.labels["backend"], s.labels["status"]) for s in refused
                if s.labels["status"] != "200"] == [("m", "", "429")]


@pytest.mark.parametrize("mode", ["badusage", "listusage"])
def test_a_malformed_usage_never_fails_the_answer(backend, tmp_path, caplog, mode):
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/{mode}"]}) as (gw, app), caplog.at_level(logging.WARNING):
        answer = _post(gw, "m")
        assert answer.status_code == 200, answer.text
        row = _spend_row(app, answer.headers["x-request-id"])
        assert row["status"] == "success"
        assert (row["prompt_tokens"], row["completion_tokens"]) == ((0, 8) if mode == "badusage" else (0, 0))
        if mode == "badusage":
            stream = _post(gw, "m", stream=True)
            assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
            assert "error" not in stream.text
            assert _spend_row(app, stream.headers["x-request-id"])["status"] == "success"
    warnings = [r.getMessage() for r in caplog.records if "malformed usage" in r.getMessage()]
    assert warnings and all(f"{url}/{mode}" in w for w in warnings)
    assert len(warnings) == (2 if mode == "badusage" else 1)  # once an answer, once a stream


def test_a_stream_that_ends_without_done_is_cut(backend, tmp_path):
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/nodone"]}) as (gw, app):
        answer = _post(gw, "m", stream=True)
        assert answer.status_code == 200
        events = [e[6:] for e in answer.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "backend_stream_cut"
        row = _spend_row(app, answer.headers["x-request-id"])
        assert row["status"] == "cut" and row["completion_tokens"] == 3  # what its client got
        assert app.state.router.groups["m"].backends[0].breaker.consecutive == 1
        _a_cut_response_stream_is_stored_failed_and_kept_out_of_its_conversation(gw)


def _a_cut_response_stream_is_stored_failed_and_kept_out_of_its_conversation(gw: str) -> None:
    """A Responses stream the backend cuts ends `response.failed` and is stored as that failed response
    (it was not stored: a retrieve of its id was a 404), and its conversation is left as it was."""
    import openai
    client = openai.OpenAI(base_url=f"{gw}/v1", api_key=MASTER, max_retries=0, timeout=30)
    conversation = client.conversations.create(items=[{"role": "user", "content": "a"}])
    with client.responses.stream(model="m", input="hi", conversation=conversation.id) as stream:
        events = list(stream)
    failed = events[-1].response
    assert events[-1].type == "response.failed" and failed.error.code == "server_error", events[-1]
    stored = client.responses.retrieve(failed.id)
    assert stored.status == "failed" and stored.output_text == "t0t1t2" == failed.output_text
    assert [item.content[0].text for item in client.conversations.items.list(conversation.id)] == ["a"]


def test_a_request_aiohttp_refuses_to_build_is_the_backends_failure_not_a_400(backend, tmp_path):
    """aiohttp refuses a URL's credentials with an Authorization header (a ValueError); a config
    file cannot say so any more (tests/test_gateway_config.py), so the URL is changed under it."""
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/ok"]}) as (gw, app):
        config = app.state.router.groups["m"].backends[0].config
        config.url, config.api_key = url.replace("://", "://user:pw@") + "/ok", "sk-upstream"
        for stream in (False, True):
            answer = _post(gw, "m", stream=stream)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "no_backend_available"


@contextlib.contextmanager
def _database_down(app, why: str = "unable to open database file"):
    """The gateway's database refusing every new connection (its pooled ones dropped), as a stopped
    PostgreSQL does; back as it was at the end."""
    import sqlite3

    from sqlalchemy import event

    engine = app.state.store.db.engine

    def refuse(*args):
        raise sqlite3.OperationalError(why)
    event.listen(engine, "do_connect", refuse)
    engine.dispose()
    try:
        yield
    finally:
        event.remove(engine, "do_connect", refuse)


def test_a_database_outage_is_a_503_to_retry_and_the_gateway_not_ready(backend, tmp_path):
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/ok"]}, key_cache_ttl=60) as (gw, app):
        created = httpx.post(gw + "/key/generate", headers={"Authorization": f"Bearer {MASTER}"},
                             json={"max_budget": 10}).json()  # (a budget: its requests are admitted in the database)
        keyed = {"Authorization": f"Bearer {created['key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(gw + "/v1/chat/completions", headers=keyed, json=body, timeout=30).status_code == 200
        assert httpx.get(gw + "/health/readiness").status_code == 200
        with _database_down(app):
            answer = httpx.post(gw + "/v1/chat/completions", headers=keyed, json=body, timeout=30)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "database_unavailable" and answer.headers["retry-after"]
            ready = httpx.get(gw + "/health/readiness", timeout=30)
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "database_unavailable"
            other = {"Authorization": "Bearer sk-not-cached"}  # (a key's lookup fails the same way)
            assert httpx.post(gw + "/v1/chat/completions", headers=other, json=body, timeout=30).status_code == 503
        assert httpx.get(gw + "/health/readiness").status_code == 200


@pytest.mark.parametrize("why, status", [("database is locked", 503), ("no such table: api_keys", 500)])
def test_only_a_database_that_cannot_serve_is_a_503(backend, tmp_path, why, status):
    """A locked database is an outage to retry; a missing table is the gateway's fault, a 500 (every
    OperationalError was a 503 'database unavailable')."""
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/ok"]}) as (gw, app), _database_down(app, why):
        answer = httpx.post(gw + "/key/generate", headers={"Authorization": f"Bearer {MASTER}"}, json={}, timeout=30)
        assert answer.status_code == status, answer.text
        assert (answer.json()["error"]["code"] == "database_unavailable") == (status == 503)


def test_a_batch_line_answered_with_a_200_that_is_not_json_goes_to_the_error_file(backend, tmp_path):
    """Its 502 is written with the line (the line was settled without an answer: left `running`, and
    the batch completed with it in neither file)."""
    import time

    import openai

    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/text"]}) as (gw, _app):
        client = openai.OpenAI(base_url=gw + "/v1", api_key=MASTER, max_retries=0)
        line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
        uploaded = client.files.create(file=("b.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.error_file_id, batch
        record = json.loads(client.files.content(batch.error_file_id).text)
        assert record["custom_id"] == "one" and record["response"]["status_code"] == 502, record
        assert record["response"]["body"]["error"]["code"] == "backend_invalid_response"


def test_readiness_probes_share_one_database_ping_while_it_hangs(tmp_path):
    """A database that does not answer holds one worker thread, however many probes come (each
    probe's SELECT 1 used to stay blocked in its own thread past its 2 s wait)."""
    import asyncio
    import threading

    from treeserve.gateway import routes

    release, calls = threading.Event(), []

    class Hanging:
        def ping(self):
            calls.append(1)
            release.wait(30)

    async def probes():
        ping = routes.DatabasePing(Hanging())
        answers = await asyncio.gather(*(ping.answers() for _ in range(4)))
        again = await ping.answers()  # (still hanging: still the one ping)
        release.set()
        await asyncio.sleep(0.1)
        return answers, again, await ping.answers()

    routes.PING_TIMEOUT, saved = 0.3, routes.PING_TIMEOUT
    try:
        answers, again, after = asyncio.run(probes())
    finally:
        routes.PING_TIMEOUT = saved
    assert answers == [False] * 4 and again is False and after is True
    assert len(calls) == 2  # the hanging one, then a new one once it had answered


def test_a_backend_whose_tokenize_has_no_count_still_serves_truncation_auto(backend, tmp_path):
    """A Responses request with `truncation: "auto"` is counted before its chat (a backend's /tokenize);
    a backend whose /tokenize answers without a `count` (llama.cpp's shape) is one that cannot count:
    the chat is sent as it is, and Anthropic's count_tokens is the backend's 502, not the gateway's 500.
    Before: a KeyError, a 500 for every such response."""
    url, _ = backend
    with gateway(tmp_path, {"m": [f"{url}/llamacpp"]}) as (gw, _):
        auth = {"Authorization": f"Bearer {MASTER}"}
        response = httpx.post(gw + "/v1/responses", headers=auth, timeout=30,
                              json={"model": "m", "input": "hi", "truncation": "auto"})
        assert response.status_code == 200 and response.json()["output"][0]["content"][0]["text"] == "ok", response.text
        counted = httpx.post(gw + "/v1/messages/count_tokens", headers=auth, timeout=30,
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert counted.status_code == 502 and counted.json()["type"] == "error", counted.text


def test_a_model_whose_replicas_are_cut_off_goes_to_its_fallback_before_them(backend, tmp_path):
    """A model whose only replica has its circuit open (or fails its health check) is served by its
    fallback at once, the cut-off replica kept as the last resort after it (LiteLLM's cooldown leaves such
    a deployment out and goes to the fallbacks). Before, every request went 1 + retries times to that
    replica first: with a host that does not answer, three connect timeouts (15 s) before each answer."""
    url, fake = backend
    with gateway(tmp_path, {"m": [f"{url}/503"], "spare": [f"{url}/ok"]}, {"m": ["spare"]},
                 breaker_failures=1, breaker_cooldown=60) as (gw, app):
        assert _post(gw, "m").status_code == 200  # (m's replica fails: its circuit opens)
        assert app.state.router.groups["m"].backends[0].breaker.state == "open"
        for stream in (False, True):
            fake.state.calls.clear()
            answer = _post(gw, "m", stream=stream)
            assert answer.status_code == 200, answer.text
            assert fake.state.calls == ["ok"]
            assert _spend_row(app, answer.headers["x-request-id"])["model"] == "spare"
    with gateway(tmp_path, {"m": [f"{url}/503"], "spare": [f"{url}/503"]}, {"m": ["spare"]},
                 breaker_failures=1, breaker_cooldown=60, retries=0) as (gw, app):
        assert _post(gw, "m").status_code == 503  # (both circuits open now)
        fake.state.calls.clear()
        assert _post(gw, "m").status_code == 503 and fake.state.calls == ["503", "503"]  # (still tried, last)


def test_a_lone_replica_cut_off_is_answered_at_once_with_a_503_naming_why(tmp_path):
    """A model whose only replica fails its health check and has its circuit open (no fallback) is
    answered at once: a 503 naming the model, the replica and its last error, with Retry-After the seconds
    until its circuit lets a trial through (LiteLLM's cooldown: "No deployments available ... Try again in
    N seconds"). Before, every request still went to it 1 + retries times (a connect timeout each where its
    host does not answer). The key in its URL's query is shown nowhere (it was, in the 503 and the label)."""
    dead = "http://127.0.0.1:9/v1?api_key=SECRETKEY"  # (nothing listens on the discard port)
    label = 'treeserve_gateway:backend_failures_total{backend="http://127.0.0.1:9/v1?api_key=***",'
    with gateway(tmp_path, {"m": [dead]}, breaker_failures=1, breaker_cooldown=60, retries=2,
                 health_interval=0.1) as (gw, app):
        replica = app.state.router.groups["m"].backends[0]
        wait_for(lambda: not replica.healthy, timeout=10)

        def failures() -> float:
            metrics = httpx.get(gw + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
            assert "SECRETKEY" not in metrics
            return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(label))
        tried = _post(gw, "m")  # (its circuit closed: tried, 1 + retries times; its circuit opens)
        assert tried.status_code == 503 and failures() == 3, tried.text
        for stream in (False, True):
            answer = _post(gw, "m", stream=stream)
            assert answer.status_code == 503 and failures() == 3, answer.text  # (not tried again)
            message = answer.json()["error"]["message"]
            assert message.startswith("model 'm': no backend could answer (each backend fails its health check "
                                      "and has its circuit open"), message
            assert "http://127.0.0.1:9/v1?api_key=***: ClientConnectorError" in message, message
            assert 55 <= int(answer.headers["retry-after"]) <= 60
            assert "SECRETKEY" not in tried.text + answer.text


def test_a_backend_url_with_a_query_sends_it_with_every_request(backend, tmp_path):
    """A backend URL with a query (a provider's `?api-version=...`, `?key=...`) has it on each request, after
    the route: it was joined after the query (`?api-version=1/v1/chat/completions`), so no request reached
    the route."""
    url, fake = backend
    with gateway(tmp_path, {"m": [f"{url}/ok?api-version=2024-02-01&key=K"]}) as (gw, _):
        fake.state.calls.clear(), fake.state.queries.clear()
        for stream in (False, True):
            assert _post(gw, "m", stream=stream).status_code == 200
        assert fake.state.calls == ["ok", "ok"] and fake.state.queries == ["api-version=2024-02-01&key=K"] * 2


def _limited_backend(gate):
    """A server that refuses `max_tokens` (or `max_completion_tokens`) over 64 or `n` over 8 (400, as any
    real one does), and holds a stream open after its first chunk until `gate` is set."""
    import asyncio

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if max(body.get("max_tokens", 1), body.get("max_completion_tokens", 1)) > 64 or body.get("n", 1) > 8:
            return JSONResponse({"error": {"message": "max_tokens or n too large", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        if not body.get("stream"):
            return _answer(USAGE)

        async def events():
            yield _chunk("t0", dict(USAGE, completion_tokens=1))
            await asyncio.to_thread(gate.wait, 30)
            yield _chunk("t1", dict(USAGE, completion_tokens=2))
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


def test_a_request_asking_for_more_tokens_than_any_model_makes_is_refused_by_its_backend_not_a_500(tmp_path):
    """A client's `max_tokens: 1e20` or `n: 1e400` is passed on for the backend to refuse (its 400), and
    holds no more than MOST_COMPLETION_TOKENS meanwhile. Before: a 500 OverflowError (a worst case past
    what a float converts; under a tpm_limit, past what the minute's BIGINT holds), and a worst case of
    1e17 reserved beside a stream's hold absorbed it in the key's float `reserved`: released, it took the
    stream's hold with it, and the stream's settlement left `reserved` below 0 (the budget that much larger)."""
    import threading

    gate = threading.Event()
    with running_server(_limited_backend(gate)) as url, gateway(tmp_path, {"m": [url]}) as (gw, app):
        admin = {"Authorization": f"Bearer {MASTER}"}
        budgeted = httpx.post(gw + "/key/generate", json={"max_budget": 1.0}, headers=admin).json()["key"]
        limited = httpx.post(gw + "/key/generate", json={"tpm_limit": 1000}, headers=admin).json()["key"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {budgeted}"},
                          json=body | {"stream": True, "max_tokens": 8}, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # (admitted: its hold in place)
            for key in (budgeted, limited):
                for huge in ({"max_tokens": 10**20}, {"n": 10**400}, {"max_completion_tokens": 10**400}):
                    refused = httpx.post(gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                         json=body | huge, timeout=30)
                    assert refused.status_code in (400, 429), (key == limited, huge, refused.text)
                    assert refused.status_code == 400 or refused.json()["error"]["param"] == "tpm_limit"
            gate.set()
            assert any("[DONE]" in line for line in lines)

        def settled():
            info = httpx.get(gw + "/key/info", params={"key": budgeted}, headers=admin).json()["info"]
            return info["spend"] > 0 and info
        info = wait_for(settled)
        assert info["spend"] == pytest.approx(2e-3) and info["reserved"] == pytest.approx(0.0, abs=1e-9)


def test_a_count_the_worst_case_cannot_read_is_a_400_and_best_of_is_held_in_full(tmp_path):
    """`n: 4.0`, `max_completion_tokens: "900"`: vLLM (pydantic's lax ints) reads them as 4 and 900 and
    generates that many, but the gateway counted only integers: it held one choice, or the model's cap,
    which such a `max_completion_tokens` overrode upstream; a budget's or a tpm_limit's hold was that much
    short. Now each is a 400 naming the field (OpenAI's answer to a decimal count). And `best_of` (legacy
    completions': best_of generated, n returned) is held as that many choices; it was held as one."""
    import threading

    gate = threading.Event()
    with running_server(_limited_backend(gate)) as url, gateway(tmp_path, {"m": [url]}) as (gw, app):
        admin = {"Authorization": f"Bearer {MASTER}"}
        budgeted = httpx.post(gw + "/key/generate", json={"max_budget": 1.0}, headers=admin).json()["key"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for bad in ({"n": 4.0}, {"max_completion_tokens": "900"}, {"max_tokens": 64.0}, {"best_of": True}):
            refused = httpx.post(gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {budgeted}"},
                                 json=body | bad, timeout=30)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(bad)), refused.text
        assert httpx.post(gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {budgeted}"},
                          json=body | {"best_of": None, "max_tokens": 8}, timeout=30).status_code == 200  # (null: not given)
        with httpx.stream("POST", gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {budgeted}"},
                          json=body | {"stream": True, "max_tokens": 8, "best_of": 4}, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # (admitted: its hold in place)
            info = httpx.get(gw + "/key/info", params={"key": budgeted}, headers=admin).json()["info"]
            assert info["reserved"] == pytest.approx(4 * 8 * 1e-3)  # (4 choices of 8 tokens at 1e-3; no input price)
            gate.set()
            assert any("[DONE]" in line for line in lines)


def test_max_tokens_beside_a_max_completion_tokens_of_0_is_held(tmp_path):
    """`max_completion_tokens: 0, max_tokens: 8`: vLLM and SGLang read `max_completion_tokens or
    max_tokens`, 8, but the gateway counted the first field given, 0: the request held nothing of its
    completion. The larger of the two is held now (and a 0 alone is no cap: the model's goes upstream)."""
    import threading

    gate = threading.Event()
    with running_server(_limited_backend(gate)) as url, gateway(tmp_path, {"m": [url]}) as (gw, app):
        admin = {"Authorization": f"Bearer {MASTER}"}
        budgeted = httpx.post(gw + "/key/generate", json={"max_budget": 1.0}, headers=admin).json()["key"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", gw + "/v1/chat/completions", headers={"Authorization": f"Bearer {budgeted}"},
                          json=body | {"max_completion_tokens": 0, "max_tokens": 8}, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # (admitted: its hold in place)
            info = httpx.get(gw + "/key/info", params={"key": budgeted}, headers=admin).json()["info"]
            assert info["reserved"] == pytest.approx(8 * 1e-3)  # (8 tokens at 1e-3; no input price)
            gate.set()
            assert any("[DONE]" in line for line in lines)
