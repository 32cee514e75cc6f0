"""Hostile and malformed requests get the documented status and schema; load and disconnects leak nothing."""
import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import API_KEY, assert_no_leak, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _chat(**changes):
    body = dict(CHAT)
    body.update(changes)
    return json.dumps(body).encode()


def _without(key):
    return json.dumps({k: v for k, v in CHAT.items() if k != key}).encode()


CASES = [
    # (name, method, path, body bytes or None, headers, expected status, expected param or None)
    ("malformed json", "POST", "/v1/chat/completions", b"{not json", AUTH, 400, None),
    ("empty body", "POST", "/v1/chat/completions", b"", AUTH, 400, None),
    ("json array body", "POST", "/v1/chat/completions", b"[1, 2]", AUTH, 400, None),
    ("invalid utf-8", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": "\xff\xfe"}', AUTH, 400, None),
    # (a missing model is the served one, as vLLM's: test_unnamed_model.py)
    ("model not a string", "POST", "/v1/chat/completions", _chat(model=5), AUTH, 400, "model"),
    ("missing messages", "POST", "/v1/chat/completions", _without("messages"), AUTH, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", _chat(messages=[]), AUTH, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400,
     "messages[0].role"),
    ("content wrong type", "POST", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), AUTH,
     400, None),
    ("temperature string", "POST", "/v1/chat/completions", _chat(temperature="hot"), AUTH, 400, "temperature"),
    ("negative temperature", "POST", "/v1/chat/completions", _chat(temperature=-1), AUTH, 400, "temperature"),
    ("top_p zero", "POST", "/v1/chat/completions", _chat(top_p=0), AUTH, 400, "top_p"),
    ("top_p huge", "POST", "/v1/chat/completions", _chat(top_p=7.5), AUTH, 400, "top_p"),
    ("n zero", "POST", "/v1/chat/completions", _chat(n=0), AUTH, 400, "n"),
    ("n 10000", "POST", "/v1/chat/completions", _chat(n=10000), AUTH, 400, "n"),
    ("n as bool", "POST", "/v1/chat/completions", _chat(n=True), AUTH, 400, "n"),
    ("negative max_tokens", "POST", "/v1/chat/completions", _chat(max_tokens=-5), AUTH, 400, "max_tokens"),
    ("huge max_tokens", "POST", "/v1/chat/completions", _chat(max_tokens=10**12), AUTH, 400, "max_tokens"),
    ("max_tokens float", "POST", "/v1/chat/completions", _chat(max_tokens=2.5), AUTH, 400, "max_tokens"),
    ("presence penalty", "POST", "/v1/chat/completions", _chat(presence_penalty=9), AUTH, 400, "presence_penalty"),
    ("stop wrong type", "POST", "/v1/chat/completions", _chat(stop=42), AUTH, 400, "stop"),
    ("seed string", "POST", "/v1/chat/completions", _chat(seed="abc"), AUTH, 400, "seed"),
    ("top_logprobs no logprobs", "POST", "/v1/chat/completions", _chat(top_logprobs=3), AUTH, 400, "top_logprobs"),
    ("top_logprobs too many", "POST", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=99), AUTH, 400,
     "top_logprobs"),
    # (-1, the whole vocabulary offline as vLLM's, is no count a request over HTTP may ask for: a dict
    # of every token per token; vLLM's server takes it only where --max-logprobs -1 allows)
    ("top_logprobs whole vocabulary", "POST", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=-1), AUTH,
     400, "top_logprobs"),
    ("prompt_logprobs whole vocabulary", "POST", "/v1/chat/completions", _chat(prompt_logprobs=-1), AUTH, 400,
     "prompt_logprobs"),
    ("completions logprobs whole vocabulary", "POST", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": "a", "logprobs": -1}).encode(), AUTH, 400, "logprobs"),
    ("completions prompt_logprobs whole vocabulary", "POST", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": "a", "prompt_logprobs": -1}).encode(), AUTH, 400, "prompt_logprobs"),
    ("stream_options bad", "POST", "/v1/chat/completions", _chat(stream_options={"include_usage": "yes"}), AUTH, 400,
     None),
    ("unknown model", "POST", "/v1/chat/completions", _chat(model="gpt-9"), AUTH, 404, "model"),
    ("prompt over context", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "word " * 2000}]), AUTH, 400, "messages"),
    ("ten megabyte body", "POST", "/v1/chat/completions", b'{"x": "' + b"a" * (10 << 20) + b'"}', AUTH, 413, None),
    ("missing key", "POST", "/v1/chat/completions", _chat(), {}, 401, None),
    ("wrong key", "POST", "/v1/chat/completions", _chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("wrong key on metrics", "GET", "/metrics", None, {"Authorization": "Bearer nope"}, 401, None),
    ("missing key on models", "GET", "/v1/models", None, {}, 401, None),
    ("missing key on tokenize", "POST", "/tokenize", b'{"prompt": "x"}', {}, 401, None),
    ("unknown route", "GET", "/v1/nothing-here", None, AUTH, 404, None),
    ("completions suffix", "POST", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": "a", "suffix": "b"}).encode(), AUTH, 400, "suffix"),
    ("completions empty prompt", "POST", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": ""}).encode(), AUTH, 400, "prompt"),
    ("completions token out of vocab", "POST", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": [1, 2, 10**9]}).encode(), AUTH, 400, "prompt"),
    ("completions prompt wrong type", "POST", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": {"a": 1}}).encode(), AUTH, 400, "prompt"),
    ("detokenize out of vocab", "POST", "/detokenize", json.dumps({"tokens": [-1]}).encode(), AUTH, 400, "tokens"),
    ("tokenize nothing", "POST", "/tokenize", b"{}", AUTH, 400, "prompt"),
]


@pytest.mark.parametrize("name, method, path, body, headers, status, param", CASES, ids=[c[0] for c in CASES])
def test_hostile_requests(server, name, method, path, body, headers, status, param):
    resp = httpx.request(method, server.url + path, content=body, headers={**headers, "Content-Type":
                                                                              "application/json"}, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    assert "Traceback" not in resp.text


def test_still_serving_after_hostile_requests(server):
    resp = httpx.post(server.url + "/v1/chat/completions", content=_chat(), headers={**AUTH, "Content-Type":
                                                                                   "application/json"}, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["role"] == "assistant"
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def test_queue_full_gets_429_with_retry_after(server):
    engine = server.async_engine
    old, engine.max_queue = engine.max_queue, 0
    try:
        resp = httpx.post(server.url + "/v1/chat/completions", content=_chat(), headers={**AUTH, "Content-Type":
                                                                                       "application/json"})
    finally:
        engine.max_queue = old
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "queue_full"


def test_200_concurrent_streams(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8,
            "temperature": 1.0, "stream": True, "ignore_eos": True}

    async def one(client, i):
        events = []
        async with client.stream("POST", "/v1/chat/completions", json={**body, "seed": i}, headers=AUTH) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line:
                    events.append(line)
        return events

    async def run():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run())
    for events in results:
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def test_disconnect_aborts_within_one_step(server):
    engine, async_engine = server.engine, server.async_engine
    marks = {}
    original_abort, original_engine_abort = async_engine.abort, engine.abort_request

    def abort(request_id):
        marks.setdefault("requested", engine.num_steps)
        original_abort(request_id)

    def engine_abort(request_id):
        marks.setdefault("done", engine.num_steps)
        marks["blocks_after"] = None
        original_engine_abort(request_id)
        marks["blocks_after"] = engine.kv.num_blocks_in_use()

    async_engine.abort, engine.abort_request = abort, engine_abort
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on forever"}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        break  # first chunk, then hang up
        deadline = time.monotonic() + 20
        while "done" not in marks and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        async_engine.abort, engine.abort_request = original_abort, original_engine_abort
    assert "done" in marks, "the request was not aborted"
    assert marks["done"] - marks["requested"] <= 1
    assert marks["blocks_after"] == 0  # its blocks were released by the abort itself
    wait_idle(server.engine)
    assert_no_leak(engine)


def _leave_once_the_engine_runs_it(server, path: str, body: dict) -> None:
    """Sends the request on a socket of its own and closes it once the engine holds the request (a
    client timeout of a fixed 0.3 s could fire before a busy server had submitted it: then there was
    nothing to abort, and the test failed on a loaded machine)."""
    wait_idle(server.engine)  # (so that the engine's work below is this request's)
    url = urlsplit(server.url)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    with socket.create_connection((url.hostname, url.port)) as client:
        client.sendall(head.encode() + payload)
        deadline = time.monotonic() + 30
        while not server.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.engine.has_unfinished_requests(), "the engine never received the request"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on forever"}]}),
    ("/v1/completions", {"prompt": "Go on forever"}),
])
def test_a_client_that_leaves_before_its_whole_answer_has_its_request_aborted(server, path, body):
    """A non-streamed request whose client hangs up (a timeout, a worker giving it back): its engine
    requests are aborted, not run to an answer nobody reads (which also held a server's shutdown
    until uvicorn cancelled the handler, with a traceback for each)."""
    aborted = []
    original_abort = server.async_engine.abort

    def abort(request_id):
        aborted.append(request_id)
        original_abort(request_id)

    server.async_engine.abort = abort
    try:
        body = dict(body, model="tiny", max_tokens=400, n=16, ignore_eos=True)
        _leave_once_the_engine_runs_it(server, path, body)
        deadline = time.monotonic() + 20
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.async_engine.abort = original_abort
    assert len(aborted) == 1, "its request (16 samples: one engine request) was not aborted"
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def _metric_values(text):
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{" + sample.labels.get("finished_reason", "") + "}"
                                 if "finished_reason" in sample.labels else "")
            values[key] = values.get(key, 0) + sample.value
    return values


def test_metrics_move_after_a_request(server):
    before = _metric_values(httpx.get(server.url + "/metrics", headers=AUTH).text)
    resp = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5,
                                                            "ignore_eos": True}, headers=AUTH, timeout=60)
    assert resp.status_code == 200
    wait_idle(server.engine)
    metrics = httpx.get(server.url + "/metrics", headers=AUTH)
    assert metrics.headers["content-type"].startswith("text/plain")
    after = _metric_values(metrics.text)
    assert after["treeserve:generation_tokens_total"] - before.get("treeserve:generation_tokens_total", 0) == 5
    assert after["treeserve:prompt_tokens_total"] > before.get("treeserve:prompt_tokens_total", 0)
    assert after["treeserve:request_success_total{length}"] > before.get("treeserve:request_success_total{length}", 0)
    assert after["treeserve:e2e_request_latency_seconds_count"] > before.get(
        "treeserve:e2e_request_latency_seconds_count", 0)
    assert after["treeserve:time_to_first_token_seconds_count"] > before.get(
        "treeserve:time_to_first_token_seconds_count", 0)
    assert after["treeserve:iteration_tokens_total_count"] > before.get("treeserve:iteration_tokens_total_count", 0)
    assert after["treeserve:prefix_cache_queries_total"] > before.get("treeserve:prefix_cache_queries_total", 0)
    for name in ("treeserve:num_requests_running", "treeserve:num_requests_waiting", "treeserve:kv_cache_usage_perc",
                 "treeserve:num_preemptions_total", "treeserve:prefix_cache_hits_total",
                 "treeserve:prefix_cache_evictions_total", "treeserve:prefix_cache_thrash_total",
                 "treeserve:inter_token_latency_seconds_count", "treeserve:request_queue_time_seconds_count",
                 "treeserve:request_prefill_time_seconds_count", "treeserve:request_decode_time_seconds_count",
                 "treeserve:kv_blocks_wanted"):
        assert name in after, name
