"""OpenAI's Files and Batch APIs on the gateway, through the official `openai` client, in front of a
real treeserve server of a tiny generator and PRM: a batch of 500 lines mixing chats, completions
and searches is answered once per line and billed per line (spend rows equal the lines' usage,
matched by request id); a gateway process killed with SIGKILL mid-batch and started again finishes
it with every line answered, billed and run on the backend once; a key whose budget runs out
mid-batch gets the rest failed with the budget error; files and batches stay with their key; bad
files are 400s naming the line; a cancelled batch stops. The batch and budget tests run on SQLite
and on PostgreSQL."""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import yaml
from sqlalchemy import create_engine, text

from conftest import API_KEY, running_server
from gateway_support import wait_for, wait_healthy
from treeserve.gateway.app import build_app as build_gateway
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig
from treeserve.ports import free_port
from treeserve.server.launch import build_app

MASTER = "sk-master-batches"
IN_PRICE, OUT_PRICE = 1e-6, 1e-3
FIXED = {"max_tokens": 4, "min_tokens": 4}  # every chat and completion answer is 4 tokens


@pytest.fixture(scope="module")
def backend(pair):
    app = build_app(pair, max_problems_in_flight=8, dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20,
                    max_model_len=256)
    with running_server(app) as url:
        yield SimpleNamespace(url=url, app=app)


def _models(url: str) -> dict:
    return {name: {"backends": [{"url": url, "api_key": API_KEY}], "input_cost_per_token": IN_PRICE,
                   "output_cost_per_token": OUT_PRICE} for name in ("gen", "prm")}


@contextlib.contextmanager
def gateway(url: str, database: str, in_price: float = IN_PRICE):
    models = {name: ModelConfig(name, [BackendConfig(url, api_key=API_KEY)], input_cost_per_token=in_price,
                                output_cost_per_token=OUT_PRICE) for name in ("gen", "prm")}
    app = build_gateway(GatewayConfig(models=models, master_key=MASTER, database=database, health_interval=0))
    with running_server(app) as gw:
        yield gw


def _admin(url: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {MASTER}"}, timeout=60, **kwargs)


def _key(url: str, **fields) -> str:
    return _admin(url, "POST", "/key/generate", json=fields).json()["key"]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def mixed_lines(count: int) -> list[dict]:
    """Chats, completions and (one in five) searches, each line its own prompt."""
    lines = []
    for i in range(count):
        if i % 5 == 4:
            url, body = "/v1/search", {"model": "gen", "verifier": "prm", "question": f"Add {i} and three.",
                                       "strategy": "best_of_n", "n": 2, "max_tokens": 4, "seed": i,
                                       "system_prompt": ""}
        elif i % 2:
            url, body = "/v1/completions", {"model": "gen", "prompt": f"Count to {i}:", **FIXED}
        else:
            url, body = "/v1/chat/completions", {"model": "gen", "messages": [{"role": "user", "content": f"Say {i}."}],
                                                 **FIXED}
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body})
    return lines


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _start(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    uploaded = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "cancelled", "expired", "failed"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def _records(client: openai.OpenAI, batch) -> list[dict]:
    records = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            records += [json.loads(row) for row in client.files.content(file_id).text.splitlines()]
    return records


def _usage(record: dict) -> tuple[int, int]:
    usage = record["response"]["body"].get("usage") or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def check_answered_and_billed_once(gw: str, client: openai.OpenAI, key: str, batch, lines: list[dict],
                                   search: bool = True) -> None:
    """Every line once, answered with status 200; one spend row per line, with the line's request id
    and its answer's usage; the batch's usage sums them."""
    records = _records(client, batch)
    assert sorted(r["custom_id"] for r in records) == sorted(line["custom_id"] for line in lines)
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in records), \
        [r for r in records if r["error"] or r["response"]["status_code"] != 200][:3]
    assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0
    rows = _admin(gw, "GET", "/spend/logs", params={"api_key": key, "limit": 100000}).json()
    by_request = {row["request_id"]: row for row in rows}
    assert len(by_request) == len(rows) == len(lines), (len(rows), len(lines))
    for record in records:
        row = by_request[record["response"]["request_id"]]
        assert (row["prompt_tokens"], row["completion_tokens"]) == _usage(record)
        assert row["status"] == "success"
    billed = [sum(row[name] for row in rows) for name in ("prompt_tokens", "completion_tokens")]
    assert [batch.usage.input_tokens, batch.usage.output_tokens] == billed  # (the batch's usage: what it was billed)
    assert batch.usage.total_tokens == sum(billed) and batch.model == "gen"
    if search:
        line = next(r for r in records if r["custom_id"] == "line-4")
        assert line["response"]["body"]["object"] == "search.result"


def test_a_mixed_batch_of_500_lines_is_answered_and_billed_once_per_line(backend, database):
    with gateway(backend.url, database) as gw:
        key = _key(gw)
        client = _client(gw, key)
        lines = mixed_lines(500)
        batch = _start(client, lines)
        assert batch.status == "in_progress" and batch.request_counts.total == 500
        progress = []
        while batch.status in ("in_progress", "finalizing"):  # (finalizing: its files being written)
            progress.append(batch.request_counts.completed)
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id and batch.error_file_id is None
        assert progress == sorted(progress) and len(set(progress)) > 2  # counts rise while it runs
        check_answered_and_billed_once(gw, client, key, batch, lines)
        assert [b.id for b in client.batches.list()] == [batch.id]
        metrics = _admin(gw, "GET", "/metrics").text
        assert 'treeserve_gateway:batch_lines_total{outcome="answered"} 500.0' in metrics
        assert 'treeserve_gateway:batches_total{status="completed"} 1.0' in metrics


def _gateway_process(config: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "gateway", "--config", str(config),
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    wait_healthy(f"http://127.0.0.1:{port}", proc, "gateway", timeout=60)
    return proc


def test_a_gateway_killed_mid_batch_finishes_it_after_a_restart(backend, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"master_key": MASTER, "database": f"sqlite:///{tmp_path / 'gw.db'}",
                                      "health_interval": 0, "models": _models(backend.url)}))
    port, log = free_port(), tmp_path / "gateway.log"
    gw = f"http://127.0.0.1:{port}"
    proc = _gateway_process(config, port, log)
    replies = backend.app.state.idempotent_replies
    completed_before, replayed_before = replies.completed, replies.replayed
    try:
        key = _key(gw)
        client = _client(gw, key)
        lines = mixed_lines(500)
        batch = _start(client, lines)
        assert wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 100, timeout=300)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        with pytest.raises(openai.APIConnectionError):  # it is down
            client.batches.retrieve(batch.id)
        proc = _gateway_process(config, port, log)
        assert 100 <= client.batches.retrieve(batch.id).request_counts.completed < 500  # (what was answered)
        batch = _wait(client, batch.id)
        assert batch.status == "completed"
        check_answered_and_billed_once(gw, client, key, batch, lines)
        # and run once: the lines in flight at the kill, sent again, were answered from their first run
        # where it had ended (a search whose client left is cancelled, and runs again)
        assert replies.completed - completed_before == len(lines)
        print(f"killed mid-batch: {replies.replayed - replayed_before} line(s) sent again were answered from "
              f"their first run")
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)


def test_a_key_whose_budget_runs_out_mid_batch_gets_the_rest_failed(backend, database):
    with gateway(backend.url, database) as gw:
        # a chat of 4 tokens costs about 4e-3 (+ its prompt): the budget pays for about ten of the 40
        key = _key(gw, max_budget=0.04)
        client = _client(gw, key)
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "gen", "messages": [{"role": "user", "content": f"Say {i}."}], **FIXED}}
                 for i in range(40)]
        batch = _wait(client, _start(client, lines).id)
        assert batch.status == "completed"
        records = _records(client, batch)
        assert sorted(r["custom_id"] for r in records) == sorted(line["custom_id"] for line in lines)
        answered = [r for r in records if r["error"] is None]
        refused = [r for r in records if r["error"] is not None]
        assert answered and refused and batch.request_counts.failed == len(refused)
        assert all(r["error"]["code"] == "budget_exceeded" and "budget" in r["error"]["message"] for r in refused)
        spend = _admin(gw, "GET", "/key/info", params={"key": key}).json()["info"]["spend"]
        rows = _admin(gw, "GET", "/spend/logs", params={"api_key": key}).json()
        # admitted while spend + holds < max_budget (as LiteLLM's): the last one admitted may go past it
        assert len(rows) == len(answered) and spend - max(row["cost"] for row in rows) < 0.04 <= spend
        assert sum(row["cost"] for row in rows) == pytest.approx(spend)
        print(f"budget 0.04: {len(answered)} lines answered (spend {spend:.6f}), {len(refused)} failed with "
              "budget_exceeded")


def test_lines_wait_for_a_budget_that_the_lines_in_flight_hold(backend, tmp_path):
    """A line's worst case (its prompt counted as one token a byte) is ~4x what it costs here; the
    batch's lines in flight hold more than the budget, yet everything it can pay for runs."""
    with gateway(backend.url, f"sqlite:///{tmp_path / 'gateway.db'}", in_price=1e-4) as gw:
        key = _key(gw, max_budget=0.25)
        client = _client(gw, key)
        text = "the " * 100
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "gen", "messages": [{"role": "user", "content": f"{text}{i}"}], **FIXED}}
                 for i in range(12)]
        batch = _wait(client, _start(client, lines).id)
        rows = _admin(gw, "GET", "/spend/logs", params={"api_key": key}).json()
        worst = 1e-4 * len(json.dumps(lines[0]["body"]["messages"])) + OUT_PRICE * FIXED["max_tokens"]
        assert 8 * worst > 0.25 > sum(row["cost"] for row in rows)  # 8 lines in flight hold more than it all
        assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0, batch.request_counts
        check_answered_and_billed_once(gw, client, key, batch, lines, search=False)


def test_files_and_batches_stay_with_their_key_and_bad_input_is_named(backend, tmp_path):
    with gateway(backend.url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        owner, other = _client(gw, _key(gw)), _client(gw, _key(gw))
        uploaded = owner.files.create(file=("b.jsonl", _jsonl(mixed_lines(3))), purpose="batch")
        assert owner.files.retrieve(uploaded.id).bytes == len(_jsonl(mixed_lines(3)))
        assert owner.files.content(uploaded.id).content == _jsonl(mixed_lines(3))
        assert [f.id for f in owner.files.list()] == [uploaded.id]
        for call in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                     lambda: other.files.delete(uploaded.id),
                     lambda: other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.BadRequestError, match="purpose"):
            owner.files.create(file=("b.jsonl", b"{}"), purpose="fine-tune")
        bad = [b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {"model": "gen"}}\nnot json\n',
               b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"model": "gen"}}\n',
               _jsonl(mixed_lines(1) * 2), b'{"custom_id": "a", "url": "/v1/completions", "body": {"model": "gen", '
                                          b'"prompt": "x", "stream": true}}\n',
               _jsonl(mixed_lines(1)) + _jsonl([dict(mixed_lines(1)[0], custom_id="x" * 257)]),  # (PostgreSQL: a 500)
               _jsonl([dict(mixed_lines(1)[0], custom_id="a\x00b")])]
        codes = ("invalid_json_line", "url_mismatch", "duplicate_custom_id", "invalid_request", "invalid_custom_id",
                 "invalid_custom_id")
        for content, line, code in zip(bad, (2, 1, 2, 1, 2, 1), codes):  # (OpenAI's: created, then failed)
            file = owner.files.create(file=("bad.jsonl", content), purpose="batch")
            failed = owner.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            assert failed.status == "failed" and failed.failed_at and failed.in_progress_at is None
            assert [(e.line, e.code) for e in failed.errors.data] == [(line, code)], failed.errors
            assert f"line {line}" in failed.errors.data[0].message
            assert failed.request_counts.total == 0 and owner.batches.retrieve(failed.id).status == "failed"
        with pytest.raises(openai.BadRequestError, match="metadata"):  # OpenAI's limits: 16 pairs, 64/512 characters
            owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={f"k{i}": "v" for i in range(17)})
        batch = owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.cancel(batch.id)
        assert _wait(owner, batch.id).status == "completed"
        with pytest.raises(openai.APIStatusError) as caught:
            owner.batches.cancel(batch.id)
        assert caught.value.status_code == 409
        everything_wrong = owner.files.create(file=("all.jsonl", b'[1]\n\n{"custom_id": ""}\n\xff\n'
                                                                 b'{"custom_id": "a", "method": "GET"}\n'
                                                                 b'{"custom_id": "b", "body": {"model": 1}}\n'),
                                              purpose="batch")
        failed = owner.batches.create(input_file_id=everything_wrong.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert [(e.line, e.code, e.param) for e in failed.errors.data] == [
            (1, "invalid_json_line", None), (3, "missing_required_parameter", "custom_id"),
            (4, "invalid_json_line", None), (5, "invalid_method", "method"), (6, "missing_required_parameter", "body")]
        empty = owner.files.create(file=("empty.jsonl", b"\n \n"), purpose="batch")
        assert [e.code for e in owner.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h").errors.data] == ["empty_file"]
        assert [b.status for b in owner.batches.list()].count("failed") == len(bad) + 2
        newest_first = [f.id for f in owner.files.list()]  # the upload, the bad files, the output file
        assert len(newest_first) == 10 and newest_first[-1] == uploaded.id
        assert [f.id for f in owner.files.list(limit=3)] == newest_first  # (the client follows has_more)
        assert [f.id for f in owner.files.list(limit=3, order="asc")] == newest_first[::-1]
        assert owner.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            owner.files.retrieve(uploaded.id)


def test_a_cancelled_batch_stops_and_keeps_what_was_answered(backend, tmp_path):
    with gateway(backend.url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        lines = [line for line in mixed_lines(400) if line["url"] != "/v1/search"]
        batch = _start(client, lines)
        assert wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, timeout=120)
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        batch = _wait(client, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at
        records = _records(client, batch)
        assert 10 <= len(records) == batch.request_counts.completed < len(lines)


@pytest.mark.parametrize("change, error", [({"blocked": True}, "invalid_api_key"),
                                           ({"max_budget": 1e-9}, "budget_exceeded"),
                                           ({"models": ["prm"]}, "model_not_allowed")])
def test_a_running_batch_sees_its_key_change(backend, tmp_path, change, error):
    """A key blocked, given a budget or kept to other models while its batch runs: the lines not yet
    sent fail with the key's error within a moment, as its interactive requests are refused (the
    batch read its key once and ran all its lines on it: 120 of 120 with the key blocked)."""
    database = f"sqlite:///{tmp_path / 'gw.db'}"
    with gateway(backend.url, database) as gw:
        key = _key(gw)
        client = _client(gw, key)
        lines = [line for line in mixed_lines(800) if line["url"] != "/v1/search"]
        batch = _start(client, lines)
        assert wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, timeout=120)
        changed_at = client.batches.retrieve(batch.id).request_counts.completed
        assert _admin(gw, "POST", "/key/update", json={"key": key} | change).status_code == 200
        changed = dt.datetime.now(dt.timezone.utc)
        with create_engine(database).connect() as conn:  # (a blocked key cannot look)
            assert wait_for(lambda: conn.execute(text("SELECT status FROM batches WHERE id = :i"), {"i": batch.id})
                            .scalar() == "completed", timeout=60)
        if "blocked" in change:
            _admin(gw, "POST", "/key/update", json={"key": key, "blocked": False})
        batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and changed_at <= batch.request_counts.completed < len(lines)
        errors = [json.loads(row) for row in client.files.content(batch.error_file_id).text.splitlines()]
        assert len(errors) == batch.request_counts.failed == len(lines) - batch.request_counts.completed
        assert {record["error"]["code"] for record in errors} == {error}
        # no line was sent later than a moment after the change (the batch reads its key every 0.5 s)
        sent = [dt.datetime.fromisoformat(row["started_at"]) for row in
                _admin(gw, "GET", "/spend/logs", params={"api_key": key}).json()]
        assert max(sent) < changed + dt.timedelta(seconds=1.5), (max(sent), changed)


def test_a_line_the_gateway_fails_to_send_is_sent_again_and_no_line_is_left_behind(backend, tmp_path):
    """The gateway's own error while sending one line (its database locked, say) is that line's: it
    is sent again, and the lines in hand beside it go on (they were cancelled, and those already
    marked running were never sent again: the batch completed with lines missing)."""
    models = {"gen": ModelConfig("gen", [BackendConfig(backend.url, api_key=API_KEY)])}
    app = build_gateway(GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}",
                                      health_interval=0))
    batches, failed = app.state.store.batches, []
    original = batches.mark

    def mark(batch_id, line, status, *args):
        if status == "running" and line == 5 and not failed:
            failed.append(line)
            raise RuntimeError("database is locked (simulated, once)")
        return original(batch_id, line, status, *args)
    batches.mark = mark
    with running_server(app) as gw:
        client = _client(gw, _key(gw))
        lines = [line for line in mixed_lines(60) if line["url"] != "/v1/search"]
        batch = _wait(client, _start(client, lines).id)
    assert failed and batch.status == "completed"
    assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0


def test_an_answer_that_is_no_chat_completion_is_a_failed_line_not_a_stuck_batch():
    """A /v1/responses line answered 200 with no choices (a backend's odd answer) is written to the
    error file; before, writing the files raised, over and over, and the batch stayed in progress."""
    from treeserve.gateway.batches import _output_line
    from treeserve.gateway.schema import BatchLine

    line = BatchLine(batch_id="batch_x", line=1, custom_id="r1", url="/v1/responses", status="done",
                     status_code=200, request_id="req-1", error=None, response={"choices": []},
                     body={"model": "gen", "input": "Say 1."})
    record = _output_line(line)
    assert record["response"] is None and record["error"]["code"] == "invalid_backend_response"
    assert "req-1" in record["error"]["message"]


def test_responses_lines_come_back_as_responses(backend, tmp_path):
    with gateway(backend.url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "gen", "input": f"Say {i}.", "max_output_tokens": 4, "temperature": 0}}
                 for i in range(3)]
        lines.append({"custom_id": "gone", "method": "POST", "url": "/v1/responses",
                      "body": {"model": "gen", "input": "Again.", "previous_response_id": "resp_nope"}})
        conversation = client.conversations.create()  # (a line's response would be appended in no set order)
        lines.append({"custom_id": "talk", "method": "POST", "url": "/v1/responses",
                      "body": {"model": "gen", "input": "Hi.", "conversation": conversation.id}})
        batch = _wait(client, _start(client, lines, endpoint="/v1/responses").id)
        records = _records(client, batch)
        assert len(records) == 5
        gone = next(record for record in records if record["custom_id"] == "gone")  # (OpenAI's code for it)
        assert (gone["error"]["code"], gone["error"]["param"]) == \
            ("previous_response_not_found", "previous_response_id")
        talk = next(record for record in records if record["custom_id"] == "talk")
        assert (talk["error"]["code"], talk["error"]["param"]) == ("unsupported_parameter", "conversation"), talk
        assert client.conversations.items.list(conversation.id).data == []
        for record in records[:3]:
            body = record["response"]["body"]
            assert body["object"] == "response" and body["output"][0]["type"] == "message"
            assert body["usage"]["output_tokens"] >= 1



def _echo_backend(seen: list | None = None, down_until: list | None = None):
    """A backend whose chat answer is the user's message, as it came (streamed in one chunk when
    asked); the request bodies it got go to `seen`; a 503 (as a draining server's) for each chat
    before the monotonic time `down_until[0]`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens_details": {"reasoning_tokens": 1}}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model"} for name in ("gen", "prm")]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        if down_until and time.monotonic() < down_until[0]:
            return JSONResponse({"error": {"message": "draining", "type": "service_unavailable"}}, status_code=503)
        if seen is not None:
            seen.append(body)
        text = body["messages"][-1]["content"]
        if body.get("stream"):
            chunk = {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}
            last = dict(chunk, choices=[], usage=usage)
            return StreamingResponse(iter([f"data: {json.dumps(chunk)}\n\n", f"data: {json.dumps(last)}\n\n",
                                           "data: [DONE]\n\n"]), media_type="text/event-stream")
        return {"id": "chatcmpl-echo", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": usage}

    return app


def test_a_batch_names_its_model_and_sums_its_lines_usage(tmp_path):
    """OpenAI's batch object names its `model` and sums its answered lines' `usage` (input, cached,
    output, reasoning and total tokens), zero before any line is answered; both were null."""
    with running_server(_echo_backend()) as url, gateway(url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        batch = _start(client, _echo_lines(4))
        assert batch.model == "gen" and batch.usage.total_tokens in range(0, 21), batch
        done = _wait(client, batch.id, timeout=60)
    assert done.status == "completed" and done.model == "gen"
    assert done.usage.model_dump() == {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4},
                                       "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 4},
                                       "total_tokens": 20}


def test_a_backend_set_to_take_no_priority_or_continuous_usage_is_sent_neither(tmp_path):
    """Batch lines ask their server for `priority` (batch_priority), streams for usage in every chunk;
    OpenAI's API and a vLLM server without the priority policy refuse a request with either, so a
    backend can be set to get neither (`priority: false`, `continuous_usage: false`)."""
    seen: list[dict] = []
    with running_server(_echo_backend(seen)) as url:
        models = {"gen": ModelConfig("gen", [BackendConfig(url)]),
                  "ext": ModelConfig("ext", [BackendConfig(url, priority=False, continuous_usage=False)])}
        app = build_gateway(GatewayConfig(models=models, master_key=MASTER, health_interval=0,
                                          database=f"sqlite:///{tmp_path / 'gw.db'}"))
        with running_server(app) as gw:
            client = _client(gw, _key(gw))
            lines = [{"custom_id": model, "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
                     for model in ("gen", "ext")]
            assert _wait(client, _start(client, lines).id).request_counts.completed == 2
            for model in ("gen", "ext"):
                stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "yo"}],
                                                        stream=True, stream_options={"include_usage": True},
                                                        extra_body={"priority": 0})
                assert [c.usage.total_tokens for c in stream if c.usage] == [5]
    batch_bodies = {b["model"]: b for b in seen if not b.get("stream")}
    assert batch_bodies["gen"]["priority"] == 1 and "priority" not in batch_bodies["ext"]
    streams = {b["model"]: b for b in seen if b.get("stream")}
    assert streams["gen"]["priority"] == 0 and streams["gen"]["stream_options"]["continuous_usage_stats"] is True
    assert "priority" not in streams["ext"] and streams["ext"]["stream_options"] == {"include_usage": True}


def test_text_holding_unicode_line_separators_stays_on_its_line(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 raw, and `str.splitlines` breaks at them (a
    model's answer held one in a CI run: the output file's record split in two). A batch file with
    them raw is read line by line, and the output file's records survive any line splitter."""
    texts = ["a\u2028b", "c\u2029d", "e\x85f", "g\x1ch\x0bi\x0cj", "plain"]
    lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "gen", "messages": [{"role": "user", "content": text}]}} for i, text in enumerate(texts)]
    raw = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
    with running_server(_echo_backend()) as backend_url, gateway(backend_url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        uploaded = client.files.create(file=("batch.jsonl", raw), purpose="batch")
        batch = _wait(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == len(texts), batch
        records = _records(client, batch)  # (split with str.splitlines)
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records}
    assert answers == {f"t{i}": text for i, text in enumerate(texts)}


def test_a_batch_file_over_the_line_limit_or_full_of_errors_is_named_briefly():
    from treeserve.gateway import batch_file

    line = b'{"custom_id": "%d", "body": {"model": "gen"}}'
    over = batch_file.read(b"\n".join(line % i for i in range(batch_file.MAX_LINES + 1)), "/v1/chat/completions")
    assert over.lines == [] and [e["code"] for e in over.errors] == ["too_many_tasks"]
    assert str(batch_file.MAX_LINES + 1) in over.errors[0]["message"]
    at_the_limit = batch_file.read(b"\r\n".join(line % i for i in range(batch_file.MAX_LINES)), "/v1/completions")
    assert at_the_limit.errors == [] and len(at_the_limit.lines) == batch_file.MAX_LINES
    assert at_the_limit.lines[-1] == (str(batch_file.MAX_LINES - 1), "/v1/completions", {"model": "gen"})
    with_bom = batch_file.read(b"\xef\xbb\xbf" + line % 7, "/v1/chat/completions")  # (Windows editors)
    assert with_bom.errors == [] and with_bom.lines[0][0] == "7"
    garbage = batch_file.read(b"x\n" * 500, "/v1/chat/completions")
    assert len(garbage.errors) == batch_file.MAX_ERRORS and garbage.errors[-1]["line"] == batch_file.MAX_ERRORS


def test_a_backend_outage_delays_a_batch_and_fails_none_of_its_lines(tmp_path):
    """Lines no backend can answer are sent again, backing off, for as long as the batch's window
    lasts (OpenAI's rule); before, each line failed after 5 tries a second apart, so a backend
    restart of 20 s failed about 6 lines a second of it."""
    down_until, seen = [time.monotonic() + 3600], []
    with running_server(_echo_backend(seen, down_until)) as url, \
            gateway(url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        lines = [{"custom_id": f"o{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "gen", "messages": [{"role": "user", "content": f"line {i}"}]}} for i in range(40)]
        batch = _start(client, lines)
        time.sleep(8)  # (past the 5 tries of before)
        assert client.batches.retrieve(batch.id).request_counts.failed == 0 and seen == []
        down_until[0] = 0.0
        batch = _wait(client, batch.id, timeout=120)
    assert batch.status == "completed" and batch.request_counts.completed == 40 and batch.request_counts.failed == 0
    assert sorted(b["messages"][0]["content"] for b in seen) == sorted(f"line {i}" for i in range(40))


def test_a_reward_request_through_a_model_with_a_token_cap_is_sent_without_max_tokens(backend, tmp_path):
    """A model's max_tokens cap goes on what generates: a /v1/rewards body (it has a question) got it
    too, and the server refuses a reward request's unknown fields (a reviewer's finding)."""
    models = {name: ModelConfig(name, [BackendConfig(backend.url, api_key=API_KEY)], max_tokens=64)
              for name in ("gen", "prm")}
    app = build_gateway(GatewayConfig(models=models, master_key=MASTER, health_interval=0,
                                      database=f"sqlite:///{tmp_path / 'gw.db'}"))
    with running_server(app) as gw:
        key = _key(gw)
        rewarded = httpx.post(f"{gw}/v1/rewards", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                              json={"model": "prm", "question": "Add 2 and 3.", "steps": ["2 + 3 = 5."]})
        assert rewarded.status_code == 200 and len(rewarded.json()["scores"]) == 1, rewarded.text



def test_searches_sent_back_to_back_on_a_key_with_a_tpm_limit_below_their_worst_case_are_admitted(backend, tmp_path):
    """A search holds its worst case (n x num_iterations x max_tokens, here over the key's whole tpm_limit)
    in its minute while it runs, admitted in an empty minute; its answer puts what it used in its place
    at once: the next search sent as the last one ended was refused (a 429 to retry at the minute's
    end) until the settlement's batch committed."""
    question = {"model": "gen", "verifier": "prm", "question": "Add 2 and three.", "strategy": "beam", "n": 4,
                "num_iterations": 4, "max_tokens": 4, "seed": 1, "system_prompt": ""}  # worst case ~100 tokens
    with gateway(backend.url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        key = {"Authorization": f"Bearer {_key(gw, tpm_limit=90)}"}
        used = 0
        for _ in range(2):
            answer = httpx.post(f"{gw}/v1/search", headers=key, json=question, timeout=60)
            assert answer.status_code == 200, answer.text
            used += answer.json()["usage"]["completion_tokens"]
        assert used < 90  # (the two fit: else the second's refusal was right)


def _echo_lines(count: int) -> list[dict]:
    return [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gen", "messages": [{"role": "user", "content": f"line {i}"}]}} for i in range(count)]


def _held(monkeypatch, owner, name: str, gate: threading.Event, entered: threading.Event) -> None:
    """`owner.name` waits for `gate` before it runs (`entered` set as it starts waiting)."""
    original = getattr(owner, name, None)

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(60)
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, held, raising=False)


def test_a_polling_client_sees_validating_in_progress_finalizing_completed(tmp_path, monkeypatch):
    """OpenAI's lifecycle, each state while it lasts: `validating` while the input file is read
    (request_counts.total 0), `in_progress` with its lines, `finalizing` while the output files are
    written, then `completed`, each with its timestamp. Before, a batch appeared only once
    validated, already `in_progress`, stayed `in_progress` while its files were written, and went
    straight to `completed`."""
    from treeserve.gateway import batch_file

    reading, read_entered, writing, write_entered = (threading.Event() for _ in range(4))
    _held(monkeypatch, batch_file, "read", reading, read_entered)
    lines = _echo_lines(5)
    with running_server(_echo_backend()) as url:
        app = build_gateway(GatewayConfig(models={"gen": ModelConfig("gen", [BackendConfig(url)])}, master_key=MASTER,
                                          health_interval=0, database=f"sqlite:///{tmp_path / 'gw.db'}"))
        _held(monkeypatch, app.state.store.batches, "_records", writing, write_entered)
        with running_server(app) as gw, ThreadPoolExecutor(1) as pool:
            client = _client(gw, _key(gw))
            uploaded = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
            creating = pool.submit(client.batches.create, input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={"run": "lifecycle"})
            assert read_entered.wait(30)
            [validating] = wait_for(lambda: client.batches.list().data, timeout=10)
            assert validating.status == "validating" and validating.request_counts.total == 0, validating
            assert validating.in_progress_at is None and validating.metadata == {"run": "lifecycle"}
            assert validating.expires_at == validating.created_at + 24 * 3600
            reading.set()
            created = creating.result(timeout=30)
            assert created.id == validating.id and created.status == "in_progress"
            assert created.request_counts.total == len(lines) and created.in_progress_at >= created.created_at
            assert write_entered.wait(60)
            finalizing = client.batches.retrieve(created.id)
            assert finalizing.status == "finalizing" and finalizing.finalizing_at >= finalizing.in_progress_at
            assert finalizing.completed_at is None and finalizing.output_file_id is None
            assert finalizing.request_counts.completed == len(lines)
            writing.set()
            done = _wait(client, created.id, timeout=60)
    assert done.status == "completed" and done.completed_at >= done.finalizing_at == finalizing.finalizing_at
    assert (done.failed_at, done.cancelling_at, done.cancelled_at, done.expired_at) == (None,) * 4
    assert done.output_file_id and done.error_file_id is None and done.metadata == {"run": "lifecycle"}


def _store(tmp_path):
    app = build_gateway(GatewayConfig(models={}, master_key=MASTER, health_interval=0,
                                      database=f"sqlite:///{tmp_path / 'gw.db'}"))
    app.state.store.migrate()
    return app.state.store


def test_a_batch_cancelled_after_its_last_line_ended_ends_cancelled(tmp_path):
    """A cancel that comes between the batch's last line and its files: the batch ends `cancelled`
    (before: `completed`, with `cancelling_at` set), never `finalizing`."""
    store = _store(tmp_path)
    uploaded = store.files.create(None, "batch", "b.jsonl", _jsonl(_echo_lines(2)))
    batch = store.batches.create(None, uploaded["id"], "/v1/chat/completions", "24h", None)
    store.batches.fail_pending(batch["id"], {"code": "x", "message": "x", "param": None})
    assert store.batches.cancel(batch["id"], None)["status"] == "cancelling"
    store.batches.finalize(batch["id"], "completed")
    ended = store.batches.get(batch["id"], None)
    assert ended["status"] == "cancelled" and ended["cancelled_at"] >= ended["cancelling_at"]
    assert ended["finalizing_at"] is None and ended["completed_at"] is None and ended["error_file_id"]


def test_a_create_that_stops_while_validating_leaves_a_failed_batch_and_runs_no_line(tmp_path, monkeypatch):
    """A create call that fails mid-validation (here an error; a killed gateway leaves its lease to
    the runner, which does the same) leaves the batch `failed` with `validation_interrupted`, never
    `validating` for good, and none of its lines runs (its creator got no batch id)."""
    import treeserve.gateway.batches as batches_module
    from treeserve.gateway import batch_file

    store = _store(tmp_path)
    uploaded = store.files.create(None, "batch", "b.jsonl", _jsonl(_echo_lines(2)))
    monkeypatch.setattr(batch_file, "read", lambda *a: (_ for _ in ()).throw(RuntimeError("disk gone")))
    with pytest.raises(RuntimeError):
        store.batches.create(None, uploaded["id"], "/v1/chat/completions", "24h", None)
    [failed] = store.batches.list(None)["data"]
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "validation_interrupted"
    monkeypatch.setattr(batches_module, "VALIDATION_LEASE", dt.timedelta(0))  # (the create's lease lapsed)
    monkeypatch.setattr(store.batches, "validate", lambda batch_id: None)  # (killed before it validated)
    killed = store.batches.create(None, uploaded["id"], "/v1/chat/completions", "24h", None)
    assert killed["status"] == "validating" and store.batches.claim("instance-a") == [killed["id"]]
    assert store.batches.take_up(killed["id"])["status"] == "validating"
    store.batches.interrupted(killed["id"])
    assert store.batches.get(killed["id"], None)["status"] == "failed"


def test_a_list_after_a_batch_that_is_not_yours_names_after(tmp_path):
    """`GET /v1/batches?after=` naming another key's batch (or none) is a 404 naming `after`, as the
    files listing's is (it named `batch_id`, a parameter the call does not have)."""
    from treeserve.gateway.errors import BatchNotFound

    store = _store(tmp_path)
    uploaded = store.files.create(None, "batch", "b.jsonl", _jsonl(_echo_lines(1)))
    batch = store.batches.create(None, uploaded["id"], "/v1/chat/completions", "24h", None)
    assert [b["id"] for b in store.batches.list(None)["data"]] == [batch["id"]]
    with pytest.raises(BatchNotFound) as caught:
        store.batches.list(7, after=batch["id"])
    assert caught.value.param == "after" and caught.value.message.startswith("after: no batch")


def test_a_batch_whose_window_ends_is_expired_with_its_unsent_lines_in_the_error_file(tmp_path):
    """The window's end (here moved to now, the backend down all along): the batch ends `expired`
    with `expired_at`, never `completed_at` or `finalizing_at` (before, `finalizing_at` was set,
    a state it never showed), and each line not answered is in the error file by its custom_id
    with `batch_expired`, counted as failed."""
    database = tmp_path / "gw.db"
    lines = _echo_lines(3)
    with running_server(_echo_backend(down_until=[time.monotonic() + 3600])) as url, \
            gateway(url, f"sqlite:///{database}") as gw:
        client = _client(gw, _key(gw))
        batch = _start(client, lines)
        with create_engine(f"sqlite:///{database}").begin() as conn:
            conn.execute(text("UPDATE batches SET expires_at = :now WHERE id = :i"),
                         {"now": dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1), "i": batch.id})
        batch = _wait(client, batch.id, timeout=60)
        assert batch.status == "expired" and batch.expired_at >= batch.in_progress_at, batch
        assert (batch.completed_at, batch.finalizing_at, batch.cancelled_at, batch.failed_at) == (None,) * 4
        assert batch.request_counts.total == batch.request_counts.failed == 3 and batch.output_file_id is None
        errors = _records(client, batch)
    assert sorted(r["custom_id"] for r in errors) == [line["custom_id"] for line in lines]
    assert {r["error"]["code"] for r in errors} == {"batch_expired"} and all(r["response"] is None for r in errors)
    with create_engine(f"sqlite:///{database}").begin() as conn:  # (its expiry was kept in completed_at)
        stored = conn.execute(text("SELECT completed_at, expired_at FROM batches WHERE id = :i"),
                              {"i": batch.id}).one()
    assert stored.completed_at is None and stored.expired_at is not None


def test_a_batch_cancelled_while_validating_runs_no_line(tmp_path, monkeypatch):
    """A cancel that comes while the create call reads the file (OpenAI takes one then): the batch is
    `cancelling`, the create call answers so, and it ends `cancelled` with none of its lines sent."""
    from treeserve.gateway import batch_file

    reading, read_entered, seen = threading.Event(), threading.Event(), []
    _held(monkeypatch, batch_file, "read", reading, read_entered)
    with running_server(_echo_backend(seen)) as url, gateway(url, f"sqlite:///{tmp_path / 'gw.db'}") as gw, \
            ThreadPoolExecutor(1) as pool:
        client = _client(gw, _key(gw))
        uploaded = client.files.create(file=("batch.jsonl", _jsonl(_echo_lines(3))), purpose="batch")
        creating = pool.submit(client.batches.create, input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
        assert read_entered.wait(30)
        [validating] = wait_for(lambda: client.batches.list().data, timeout=10)
        cancelling = client.batches.cancel(validating.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at and cancelling.in_progress_at is None
        reading.set()
        assert creating.result(timeout=30).status == "cancelling"
        ended = _wait(client, validating.id, timeout=60)
    assert ended.status == "cancelled" and ended.cancelled_at >= ended.cancelling_at and ended.request_counts.total == 0
    assert (ended.output_file_id, ended.error_file_id, ended.in_progress_at, ended.finalizing_at) == (None,) * 4
    assert seen == []


def test_a_batch_cancelled_before_its_file_is_read_is_taken_by_a_runner_at_once(tmp_path, monkeypatch):
    """A cancel that lands between the create call's insert and its read of the file: the create call
    gives up its validation lease, so a runner ends the batch now (it kept it 60 s, VALIDATION_LEASE)."""
    from treeserve.gateway.store import Store

    store = Store(f"sqlite:///{tmp_path / 'gw.db'}")
    store.migrate()
    try:
        batches = store.batches
        validate = batches.validate

        def cancelled_first(batch_id: str) -> None:
            batches.cancel(batch_id, None)
            validate(batch_id)
        monkeypatch.setattr(batches, "validate", cancelled_first)
        file_id = store.files.create(None, "batch", "b.jsonl", _jsonl(_echo_lines(2)))["id"]
        created = batches.create(None, file_id, "/v1/chat/completions", "24h", None)
        assert created["status"] == "cancelling"
        assert batches.claim("runner") == [created["id"]]
    finally:
        store.close()


def test_a_batch_cancelled_after_its_last_line_is_counted_and_logged_cancelled(tmp_path, monkeypatch, caplog):
    """The runner's metric and log say how the batch ended: `cancelled` when the cancel came after
    its last line ended (they said `completed`, as the runner had meant to end it)."""
    import asyncio
    import logging

    from treeserve.gateway.batch_runner import BatchRunner

    store = _store(tmp_path)
    uploaded = store.files.create(None, "batch", "b.jsonl", _jsonl(_echo_lines(2)))
    batch = store.batches.create(None, uploaded["id"], "/v1/chat/completions", "24h", None)
    store.batches.fail_pending(batch["id"], {"code": "x", "message": "x", "param": None})
    finalize = store.batches.finalize

    def cancelled_first(batch_id: str, ending: str = "completed"):
        store.batches.cancel(batch_id, None)
        return finalize(batch_id, ending)
    monkeypatch.setattr(store.batches, "finalize", cancelled_first)
    counts = {}
    metrics = SimpleNamespace(batches=SimpleNamespace(labels=lambda status: SimpleNamespace(
        inc=lambda: counts.update({status: counts.get(status, 0) + 1}))))
    runner = BatchRunner(store.batches, store.accounts, store.ledger, SimpleNamespace(metrics=metrics), None, "me")
    with caplog.at_level(logging.INFO, logger="treeserve.gateway"):
        asyncio.run(runner._batch(batch["id"]))
    assert store.batches.get(batch["id"], None)["status"] == "cancelled"
    assert counts == {"cancelled": 1}
    assert f"batch {batch['id']}: cancelled" in caplog.text


def test_a_file_that_takes_longer_than_the_validation_lease_to_read_is_not_interrupted(tmp_path, monkeypatch):
    """The create call renews its validation lease while it reads the file: a runner looking for
    batches meanwhile takes none, and the batch goes `in_progress`. Before, the lease (60 s) was never
    renewed, so a file that took longer to read was taken by a runner and ended `failed` with
    `validation_interrupted` (here the lease is 0.3 s, the read 1.5 s)."""
    import treeserve.gateway.batches as batches_module
    from treeserve.gateway import batch_file

    monkeypatch.setattr(batches_module, "VALIDATION_LEASE", dt.timedelta(seconds=0.3))
    reading, read_entered = threading.Event(), threading.Event()
    _held(monkeypatch, batch_file, "read", reading, read_entered)
    store = _store(tmp_path)
    uploaded = store.files.create(None, "batch", "b.jsonl", _jsonl(_echo_lines(2)))
    with ThreadPoolExecutor(1) as pool:
        creating = pool.submit(store.batches.create, None, uploaded["id"], "/v1/chat/completions", "24h", None)
        assert read_entered.wait(30)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert store.batches.claim("runner") == []
            time.sleep(0.05)
        reading.set()
        created = creating.result(timeout=30)
    assert created["status"] == "in_progress" and created["request_counts"]["total"] == 2
    assert store.batches.claim("runner") == [created["id"]]


def test_a_bad_query_parameter_is_named_as_openai_names_it(tmp_path):
    """A list's bad `limit` or `order` is a 400 naming `limit` or `order` (it named `query.limit`, FastAPI's
    location of it, which no OpenAI client sends)."""
    with gateway("http://127.0.0.1:9", f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        for call, param in [(lambda: client.files.list(limit=0), "limit"),
                            (lambda: client.batches.list(limit=101), "limit"),
                            (lambda: client.files.list(order="sideways"), "order")]:
            with pytest.raises(openai.BadRequestError) as caught:
                call()
            error = caught.value.body
            assert caught.value.param == param and error["message"].startswith(f"{param}: "), error


def test_a_batch_created_without_completion_window_is_a_400_naming_it(tmp_path):
    """`completion_window` is required, as OpenAI's create call has it (a 400 naming the parameter,
    `missing_required_parameter`); the gateway took a missing one for `24h`."""
    with running_server(_echo_backend()) as url, gateway(url, f"sqlite:///{tmp_path / 'gw.db'}") as gw:
        client = _client(gw, _key(gw))
        uploaded = client.files.create(file=("batch.jsonl", _jsonl(_echo_lines(1))), purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/batches", cast_to=object, body={"input_file_id": uploaded.id,
                                                          "endpoint": "/v1/chat/completions"})
        assert client.batches.list().data == []
    assert caught.value.param == "completion_window" and caught.value.code == "missing_required_parameter"


def test_a_batch_whose_lines_name_several_models_names_none(tmp_path):
    """`model` is the one model a batch's lines name (treeserve's batches may mix models; OpenAI's name
    one), null when they name several; its usage is zero before a line is answered."""
    store = _store(tmp_path)
    lines = _echo_lines(2)
    lines[1]["body"]["model"] = "prm"
    one, several = (store.files.create(None, "batch", "b.jsonl", _jsonl(ls))["id"] for ls in (lines[:1], lines))
    assert store.batches.create(None, one, "/v1/chat/completions", "24h", None)["model"] == "gen"
    mixed = store.batches.create(None, several, "/v1/chat/completions", "24h", None)
    assert mixed["model"] is None and mixed["usage"]["total_tokens"] == 0


@pytest.mark.parametrize("model", ["m" * 200, "gen\x00"])
def test_a_batch_whose_lines_name_a_model_no_column_holds_runs_and_names_none(model, postgres):
    """A batch's `model` is kept in a column of 128 characters (text without NUL on PostgreSQL); a
    file whose lines all named a longer model (or one with a NUL) failed its create on PostgreSQL with a
    500 (the database refused the statement) where it had run, each line answered with the backend's
    error. Such a model is not a served one: the batch names none and runs."""
    app = build_gateway(GatewayConfig(models={}, master_key=MASTER, health_interval=0,
                                      database=postgres.new_database()))
    store = app.state.store
    store.migrate()
    lines = _echo_lines(2)
    for line in lines:
        line["body"]["model"] = model
    file_id = store.files.create(None, "batch", "b.jsonl", _jsonl(lines))["id"]
    batch = store.batches.create(None, file_id, "/v1/chat/completions", "24h", None)
    assert batch["status"] == "in_progress" and batch["model"] is None and batch["request_counts"]["total"] == 2
