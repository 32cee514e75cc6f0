"""Served search on the one engine loop: concurrent searches batched together and equal to the
offline runner, SSE progress, cancellation on disconnect, the queue bound, search metrics."""
import asyncio
import json
import threading
import time

import httpx
import pytest

from conftest import running_server, wait_idle
from treeserve import Runtime
from treeserve.bench.telemetry import parse_prometheus
from treeserve.search.config import SearchConfig, declared_aggregation
from treeserve.search.prompting import prompt_token_ids
from treeserve.search.runner import SearchRunner
from treeserve.server.launch import build_app
from treeserve.wire.search import MAX_SEARCH_N

QUESTIONS = ["Add two and three, then double it.", "Take seven away from ten.", "Multiply four by five.",
             "Halve eighteen and add one."]
OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)


def _body(question: str, seed: int, **change) -> dict:
    return {"model": "gen", "verifier": "prm", "question": question, "strategy": "beam", "n": 4, "beam_width": 2,
            "num_iterations": 3, "max_tokens": 6, "system_prompt": "", "seed": seed, **change}


@pytest.fixture(scope="module")
def served(pair):
    app = build_app(pair, max_problems_in_flight=2, max_queue=3, **OPTIONS)
    with running_server(app) as url:
        yield url, app


def _metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(f"{url}/metrics").text)


def _idle(app) -> None:
    for engine in app.state.engine.engines.values():
        wait_idle(engine)


def _wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def _assert_only_kept_blocks(app) -> None:
    for engine in app.state.engine.engines.values():
        kept = engine.retained.num_blocks()
        assert engine.kv.num_blocks_in_use() == kept, f"{engine.name}: blocks held beyond the kept sequences"
        assert not engine.scheduler.running and not engine.scheduler.waiting


def test_concurrent_searches_equal_the_offline_runner(served, pair):
    url, app = served
    before = _metrics(url)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/search", json=_body(q, seed))
                                          for seed, q in enumerate(QUESTIONS[:3])))
    replies = asyncio.run(run())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    rt = Runtime(pair, **OPTIONS)
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"))
    for seed, (question, reply) in enumerate(zip(QUESTIONS, replies)):
        config = SearchConfig(strategy="beam", n=4, beam_width=2, num_iterations=3, max_tokens=6, system_prompt=None,
                              seed=seed, agg_strategy=declared_aggregation(pair["prm"]))
        offline = runner.run([question], config)[0]
        body = reply.json()
        assert [c["text"] for c in body["candidates"]] == offline.completions
        # float32 sums in another batch composition: equal up to rounding
        assert [c["score"] for c in body["candidates"]] == pytest.approx(offline.agg_scores, abs=1e-6)
        # OpenAI's usage: the prompt counted once, as the generator reads it; the verifier's reads beside it
        prompt = len(prompt_token_ids(rt.engine("gen").tokenizer, question, config))
        assert body["usage"] == offline.usage and offline.usage["prompt_tokens"] == prompt > 0
        assert body["usage"]["total_tokens"] == prompt + offline.completion_tokens
        assert body["usage"]["verifier_tokens"] > 0
    after = _metrics(url)
    finished = 'treeserve:search_problems_finished_total{model_name="gen"}'
    assert after[finished] - before.get(finished, 0) == 3
    steps = 'treeserve:iteration_tokens_total_count{model_name="prm"}'
    assert after[steps] > before.get(steps, 0), "the verifier's steps taken for searches are counted"
    assert after['treeserve:search_verifier_tokens_total{model_name="prm"}'] > 0
    assert 'treeserve:kv_blocks_kept{model_name="prm"}' in after
    _idle(app)
    _assert_only_kept_blocks(app)


@pytest.mark.parametrize(("change", "param"), [({"question": ""}, "question"), ({"question": " \n"}, "question"),
                                              ({"question": None, "messages": [{"role": "user", "content": ""}]},
                                               "messages")])
def test_an_empty_question_is_a_400_naming_it(served, change, param):
    """(it was searched: the generator's noise, hundreds of tokens per candidate)"""
    url, _ = served
    reply = httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[0], 0) | change, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and "the question is empty" in reply.json()["error"]["message"]


def test_a_verifier_left_out_is_a_400_naming_the_served_ones(served):
    """(it said "needs a served reward model (got None; served: prm)": Python's None, and no word that
    the field was missing)"""
    url, _ = served
    reply = httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[0], 0, verifier=None), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "verifier" and error["code"] == "missing_required_parameter"
    assert error["message"] == ("verifier: this field is required: strategy 'beam' ranks its candidates by a reward "
                                "model's step scores (name one of the served reward models: prm); greedy and "
                                "majority need none")


def test_a_search_takes_search_and_learns_n_of_256_and_names_n_past_its_bound(served):
    """(n was capped at 128, /v1/completions' bound: Search-and-Learn's recipes run best-of-N and DVTS
    at n=256, and its Config has no bound)"""
    url, _ = served
    reply = httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[0], 0, strategy="best_of_n", n=256, max_tokens=2),
                       timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["n"] == 256 and len(reply.json()["candidates"]) == 256
    reply = httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[0], 0, n=MAX_SEARCH_N + 1), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "n" and str(MAX_SEARCH_N) in error["message"], error


@pytest.mark.parametrize("strategy", ["greedy", "majority"])
def test_a_search_that_reads_no_verifier_reports_no_score(served, strategy):
    """(its reply said `score: 0.0` for the answer and every candidate, as if the verifier had judged
    them wrong; `treeserve search` prints `score: none` there)"""
    url, _ = served
    reply = httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[0], 0, strategy=strategy, verifier=None), timeout=300)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["verifier"] is None and body["score"] is None
    assert [c["score"] for c in body["candidates"]] == [None] * len(body["candidates"])
    assert all(c["step_scores"] == [] for c in body["candidates"])


def test_a_streamed_search_sends_progress_then_the_result(served):
    url, app = served
    events = []
    with httpx.stream("POST", f"{url}/v1/search", json=_body(QUESTIONS[0], 11, stream=True), timeout=300) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    objects = [json.loads(e) for e in events[:-1]]
    progress, result = objects[:-1], objects[-1]
    assert result["object"] == "search.result" and result["candidates"]
    assert all(p["object"] == "search.progress" for p in progress) and len(progress) >= 3
    iterations = [p["iteration"] for p in progress]
    assert iterations == sorted(iterations) and iterations[-1] >= 1
    assert progress[-1]["completion_tokens"] == result["usage"]["completion_tokens"]
    assert progress[-1]["verifier_tokens"] == result["usage"]["verifier_tokens"]
    assert progress[-1]["verifier_tokens"] > 0 and progress[-1]["best_score"] is not None
    assert progress[-1]["tree_size"] == result["tree_size"]


def test_disconnecting_a_streamed_search_aborts_its_requests_within_one_step(served):
    url, app = served
    async_engine = app.state.engine
    loop, gen = async_engine.loop, async_engine.engines["gen"]
    marks: dict = {}
    runner, post = app.state.search_runners["gen"], async_engine.post
    cancel = runner.cancel
    # the tiny generator's search ends within milliseconds: its first step is held until the server
    # has seen the client leave, so the search is still running (its requests in the engine) then
    running, release = threading.Event(), threading.Event()

    def hold_first_step(engine, outputs):
        if engine is gen and not running.is_set():
            running.set()
            release.wait(30)

    def watched_post(fn):  # the server posts the cancellation when it sees the client leave
        marks.setdefault("requested", loop.num_steps)
        post(fn)

    def watched_cancel(handle):
        marks["step"] = loop.num_steps
        cancel(handle)
        marks["left"] = list(handle.requests) + _search_requests(app)
    runner.cancel, async_engine.post = watched_cancel, watched_post
    loop.step_observers.append(hold_first_step)
    try:
        body = _body(QUESTIONS[1], 7, stream=True, num_iterations=40, max_tokens=6)
        with httpx.stream("POST", f"{url}/v1/search", json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):  # the acceptance event
                    break
            assert running.wait(30), "the search never reached the engine"
        # hung up while the search's requests run
        _wait_for(lambda: "requested" in marks)
        release.set()
        _wait_for(lambda: "left" in marks)
    finally:
        release.set()
        loop.step_observers.remove(hold_first_step)
        runner.cancel, async_engine.post = cancel, post
    assert "left" in marks, "the search was not cancelled"
    assert marks["step"] - marks["requested"] <= 1, "cancelled later than one engine step after the disconnect"
    assert marks["left"] == [], "requests of the cancelled search are still in an engine"
    _idle(app)
    _assert_only_kept_blocks(app)
    assert gen.kv.num_blocks_in_use() == 0
    assert httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[2], 1), timeout=300).status_code == 200


def _search_requests(app) -> list[str]:
    engines = app.state.engine.engines
    return [rid for e in engines.values() for rid in e.groups if rid.startswith(("search-", "score-"))]


def test_searches_past_the_queue_bound_get_429_with_retry_after(served, monkeypatch):
    url, app = served
    _slow_generator(app, monkeypatch)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            bodies = [_body(QUESTIONS[i % 4], 20 + i, num_iterations=2) for i in range(8)]
            return await asyncio.gather(*(client.post("/v1/search", json=b) for b in bodies))
    replies = asyncio.run(run())
    codes = sorted(r.status_code for r in replies)
    assert codes == [200] * 5 + [429] * 3, codes  # 2 in flight, 3 queued, the rest refused
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"
    _idle(app)
    _assert_only_kept_blocks(app)


def test_rewards_are_scored_while_a_search_runs(served, pair):
    url, app = served
    steps = ["two plus three is five.", "five doubled is ten."]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(client.post("/v1/search", json=_body(QUESTIONS[3], 5)),
                                        client.post("/v1/rewards", json={"model": "prm", "question": QUESTIONS[0],
                                                                         "steps": steps}))
    search, reward = asyncio.run(run())
    assert search.status_code == 200 and reward.status_code == 200
    offline = Runtime(pair, **OPTIONS).score_steps("prm", QUESTIONS[0], steps)
    assert reward.json()["scores"] == pytest.approx(offline, abs=1e-5)


def test_a_client_that_leaves_a_json_search_gets_it_cancelled(served, monkeypatch):
    url, app = served
    runner = app.state.search_runners["gen"]
    finished, cancelled = runner.num_finished, runner.num_cancelled
    _slow_generator(app, monkeypatch)
    errors = _server_errors(monkeypatch)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[2], 31, num_iterations=10, max_tokens=20), timeout=0.5)
    _wait_for_no_search(runner)
    assert runner.num_running == 0 and runner.num_waiting == 0, "the abandoned search is still running"
    assert runner.num_cancelled == cancelled + 1, "no search was cancelled"
    assert runner.num_finished == finished, "it ran to the end instead of being cancelled"
    assert _metrics(url)['treeserve:search_problems_cancelled_total{model_name="gen"}'] == runner.num_cancelled
    time.sleep(0.2)
    assert errors == [], "a client leaving is not a server error"
    _idle(app)
    _assert_only_kept_blocks(app)


def _wait_for_no_search(runner, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (runner.num_running or runner.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)


def _server_errors(monkeypatch) -> list[str]:
    """Messages uvicorn logs at ERROR or above while the test runs (an exception escaping the app)."""
    import logging

    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            errors.append(record.getMessage())
    logger = logging.getLogger("uvicorn.error")
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, Keep(logging.ERROR)])
    return errors


def _slow_generator(app, monkeypatch) -> None:
    """Each generator step takes 50 ms more, and no sample ends at end-of-sequence: a search of a
    few iterations lasts seconds."""
    from treeserve.engine.loaded_model import LoadedModel

    monkeypatch.setattr(LoadedModel, "eos_token_ids", property(lambda self: ()))
    gen = app.state.engine.engines["gen"]
    step = gen.step

    def slow_step():
        time.sleep(0.05)
        return step()
    monkeypatch.setattr(gen, "step", slow_step)


def test_a_client_that_leaves_while_its_search_is_being_submitted_gets_it_cancelled(served, monkeypatch):
    """The client is gone before the engine thread hands back the submitted search: the search it
    submitted is cancelled all the same, not run to the end for nobody."""
    url, app = served
    runner = app.state.search_runners["gen"]
    finished, cancelled, submit = runner.num_finished, runner.num_cancelled, runner.submit

    def slow_submit(*args, **kwargs):  # the engine thread is busy past the client's patience
        time.sleep(1.0)
        return submit(*args, **kwargs)
    monkeypatch.setattr(runner, "submit", slow_submit)
    _slow_generator(app, monkeypatch)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/search", json=_body(QUESTIONS[0], 41, num_iterations=10, max_tokens=20), timeout=0.3)
    time.sleep(1.5)  # the submission has run on the engine thread by now
    _wait_for_no_search(runner)
    assert runner.num_running == 0 and runner.num_waiting == 0, "the abandoned search is still running"
    assert runner.num_cancelled == cancelled + 1, "no search was cancelled"
    assert runner.num_finished == finished, "it ran to the end instead of being cancelled"
    _idle(app)
    _assert_only_kept_blocks(app)
