"""vLLM's `priority` on chat and completions: a request with priority 1 (the gateway's batch lines)
waits behind interactive ones sent after it; out of range is a 400 naming it."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import API_KEY, running_server, wait_idle
from treeserve.server.launch import build_app

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def one_at_a_time(llama_dir):
    """One sequence at a time: every other request waits, in the queue's order."""
    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_seqs=1)
    with running_server(app) as url:
        yield url, app


def test_a_background_request_waits_behind_an_interactive_one_sent_after_it(one_at_a_time, monkeypatch):
    url, app = one_at_a_time
    engine = app.state.engine.engine
    names = {(0, 300): "first", (1, 4): "background", (0, 5): "interactive"}  # (priority, max_tokens)
    finished: list[str] = []  # in the order the engine ends them (the replies' arrival may differ by a thread switch)
    finish = engine.scheduler.finish

    def record(request, reason, *args, **kwargs):
        finished.append(names[(request.priority, request.sampling_params.max_tokens)])
        return finish(request, reason, *args, **kwargs)
    monkeypatch.setattr(engine.scheduler, "finish", record)

    def send(name: str, priority: int, max_tokens: int) -> None:
        body = {"model": "tiny", "prompt": f"{name}:", "max_tokens": max_tokens, "ignore_eos": True,
                "priority": priority}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == max_tokens

    first = threading.Thread(target=send, args=("first", 0, 300))
    first.start()
    deadline = time.monotonic() + 30
    while not engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.005)
    waiting = [threading.Thread(target=send, args=("background", 1, 4))]
    waiting[0].start()
    while len(engine.scheduler.waiting) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    waiting.append(threading.Thread(target=send, args=("interactive", 0, 5)))
    waiting[1].start()
    while len(engine.scheduler.waiting) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.scheduler.running, "the first request ended before the others queued: make it longer"
    for thread in [first, *waiting]:
        thread.join(timeout=120)
    assert finished == ["first", "interactive", "background"]
    wait_idle(engine)


def test_priority_out_of_range_is_a_400(one_at_a_time):
    url, _ = one_at_a_time
    response = httpx.post(f"{url}/v1/chat/completions", headers=HEADERS, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "priority": 7})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
