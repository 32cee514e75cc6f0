"""The soak load's judgement of answers, against canned responses (no server, no model)."""
import asyncio
import json
import random
import types

import httpx
import pytest

from treeserve.bench import soak_load
from treeserve.bench.soak_load import LoadConfig, Problem, Requests, bad_cases, run_load, timed

PROBLEMS = [Problem("Start with 3 and work modulo 100. Step 1: + 4. What is the result?",
                    ["## Step 1: + 4, 3 + 4 = 7", "Therefore, the final answer is: $\\boxed{7}$."])]
ERROR = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
SSE = {"content-type": "text/event-stream"}


def sse(*payloads) -> bytes:
    return "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads).encode()


def outcome(kind, handler, **config):
    async def run():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(base_url="http://soak.test", transport=transport) as client:
            seed = config.pop("seed", 0)
            requests = Requests(client, LoadConfig("http://soak.test", **config), random.Random(seed), PROBLEMS)
            return await timed(kind, requests, 0.0, timeout=10)

    return asyncio.run(run())


def test_a_good_chat_is_200_without_problem():
    body = {"choices": [{"message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}]}
    result = outcome("chat", lambda request: httpx.Response(200, json=body))
    assert (result.status, result.problem) == ("200", "")


def test_a_5xx_is_recorded_as_its_status():
    result = outcome("completion", lambda request: httpx.Response(500, json=ERROR))
    assert result.status == "500" and "status 500" in result.problem
    result = outcome("bad_request", lambda request: httpx.Response(503, text="Internal Server Error"))
    assert result.status == "503" and result.problem


def expected_status(request) -> int:
    """The status each bad case expects, told apart by what it sends."""
    case = next(c for c in bad_cases(LoadConfig("http://x")) if c[2] == request.url.path and (c[3] or b"") ==
                request.content)
    return case[4]


def test_bad_requests_need_their_status_and_an_openai_error_body():
    for seed in range(12):  # each draw picks a case at random
        good = outcome("bad_request", lambda r: httpx.Response(expected_status(r), json=ERROR), seed=seed)
        assert good.problem == "" and good.status in ("400", "404", "413")
        fastapi_style = outcome("bad_request", lambda r: httpx.Response(expected_status(r), json={"detail": "x"}),
                                seed=seed)
        assert fastapi_style.status == good.status and "no OpenAI error body" in fastapi_style.problem
        accepted = outcome("bad_request", lambda r: httpx.Response(200, json={}), seed=seed)
        assert accepted.status == "200" and "expected" in accepted.problem


def test_stream_search_400_is_expected_only_when_configured():
    def refuse(request):
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(400, json=ERROR)

    assert (outcome("search_stream", refuse).problem) == ""
    refused = outcome("search_stream", refuse, stream_search_400_ok=False)
    assert refused.status == "400" and "status 400" in refused.problem


def test_stream_search_answered_with_json_is_unexpected():
    result = outcome("search_stream", lambda request: httpx.Response(200, json={"object": "search.result"}))
    assert result.status == "200" and "not SSE" in result.problem


def test_stream_search_must_end_with_the_result_and_done():
    good = sse({"object": "search.progress"}, {"object": "search.result"}, "[DONE]")
    assert outcome("search_stream", lambda r: httpx.Response(200, headers=SSE, content=good)).problem == ""
    no_result = sse({"object": "search.progress"}, "[DONE]")
    assert "not the result" in outcome("search_stream", lambda r: httpx.Response(200, headers=SSE,
                                                                                  content=no_result)).problem


def test_a_cut_stream_reads_no_further_than_its_first_events():
    chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "x"}}]}
    truncated = sse(chunk, chunk, chunk, chunk)  # no [DONE]: only a cut-off reader accepts it
    assert outcome("chat_stream_cut", lambda r: httpx.Response(200, headers=SSE, content=truncated)).problem == ""
    assert "[DONE]" in outcome("chat_stream", lambda r: httpx.Response(200, headers=SSE, content=truncated)).problem


def test_rewards_need_one_score_per_step():
    def scores(extra):
        def handler(request):
            steps = json.loads(request.content)["steps"]
            return httpx.Response(200, json={"scores": [0.5] * (len(steps) + extra)})
        return handler

    assert outcome("rewards", scores(0)).problem == ""
    assert "scores" in outcome("rewards", scores(1)).problem


def test_a_dropped_connection_is_a_connection_error():
    def drop(request):
        raise httpx.RemoteProtocolError("server disconnected", request=request)

    assert outcome("search", drop).status == "conn_error"


def test_bad_cases_cover_the_brief():
    names = {case[0] for case in bad_cases(LoadConfig("http://x"))}
    assert {"malformed json", "wrong type", "unknown model", "negative max_tokens", "oversized body",
            "unknown route"} <= names
    oversized = next(case for case in bad_cases(LoadConfig("http://x")) if case[0] == "oversized body")
    assert len(oversized[3]) > 2 << 20 and oversized[4] == 413


def test_loops_stop_by_themselves(monkeypatch):
    """The loops stop at the deadline by themselves; the clock moves only with the calls, so the
    count does not depend on how fast this machine creates its HTTP clients."""
    calls, clock = [], [0.0]

    async def fake_chat(self):
        calls.append(1)
        clock[0] += 0.05
        await asyncio.sleep(0.001)
        return 200

    for kind in ("chat", "chat_stream", "chat_stream_cut", "completion", "search", "search_stream",
                 "search_stream_cut", "rewards", "bad_request"):
        monkeypatch.setattr(Requests, kind, fake_chat)
    monkeypatch.setattr(soak_load, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    outcomes, finished = asyncio.run(run_load(LoadConfig("http://soak.test"), PROBLEMS, clients=3, seconds=1.0,
                                              clock_start=0.0))
    # 20 calls fill the second; each of the 3 loops may start one more before it sees the deadline
    assert finished and len(outcomes) == len(calls) and 20 <= len(calls) <= 23
    assert all(o.status == "200" and not o.problem for o in outcomes)


@pytest.mark.parametrize("content", [b"not json", b"{}"])
def test_an_unreadable_success_keeps_its_status_and_names_the_problem(content):
    result = outcome("completion", lambda r: httpx.Response(200, content=content))
    assert result.status == "200" and result.problem
