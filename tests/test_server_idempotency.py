"""`Idempotency-Key` on the server: a repeat of a request (same key, route and credentials) gets the
first answer without running again, also while the first still runs; errors and streams are not
kept; the same header value on another route runs on its own; a search whose client left runs to
its end for its repeat."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from conftest import API_KEY

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 1.0}


def _post(server, key: str, body: dict = BODY, api_key: str = API_KEY, path: str = "/v1/chat/completions"):
    return httpx.post(server.url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": key})


def test_a_repeat_gets_the_first_answer_without_running_again(server):
    replies = server.app.state.idempotent_replies
    completed = replies.completed
    first, again = _post(server, "k-1"), _post(server, "k-1")
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers and replies.completed == completed + 1
    other = _post(server, "k-2")  # (a sampled answer: another run has another id)
    assert other.json()["id"] != first.json()["id"]


def test_repeats_sent_together_run_once(server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _post(server, "k-together"), range(4)))
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 3


def test_errors_and_streams_are_not_kept(server):
    bad = dict(BODY, max_tokens=-1)
    assert _post(server, "k-bad", bad).status_code == 400
    assert "idempotent-replayed" not in _post(server, "k-bad", bad).headers
    streamed = dict(BODY, stream=True)
    assert "idempotent-replayed" not in _post(server, "k-stream", streamed).headers
    assert "idempotent-replayed" not in _post(server, "k-stream", streamed).headers


def test_the_same_header_on_another_route_runs_on_its_own(server):
    chat = _post(server, "k-route")
    completion = _post(server, "k-route", {"model": "tiny", "prompt": "Hello", "max_tokens": 4},
                       path="/v1/completions")
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert "idempotent-replayed" not in completion.headers and chat.json()["object"] == "chat.completion"


def test_a_search_whose_client_left_runs_to_its_end_for_its_repeat(server):
    """With an Idempotency-Key a search is not cancelled when its client leaves: the repeat gets it."""
    body = {"model": "tiny", "question": "Count.", "strategy": "majority", "n": 8, "max_tokens": 200,
            "system_prompt": "", "seed": 1}
    headers = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": "k-search"}
    replies = server.app.state.idempotent_replies
    completed = replies.completed
    with pytest.raises(httpx.TimeoutException):  # it leaves before the search has ended
        httpx.post(server.url + "/v1/search", json=body, headers=headers, timeout=0.05)
    deadline = time.monotonic() + 60
    while replies.completed == completed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replies.completed == completed + 1  # it ran to its end with nobody waiting
    again = httpx.post(server.url + "/v1/search", json=body, headers=headers, timeout=60)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["object"] == "search.result"
