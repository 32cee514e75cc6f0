"""A generator and a PRM served together: routing by `model` (404s hinting a served name), POST
/v1/rewards, per-model metrics, one "engine ready" line per model."""
import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_server, wait_idle
from treeserve import Runtime
from treeserve.server.launch import build_app
from treeserve.server.serving import unknown_model

QUESTION = "Add two and three, then double it."
STEPS = ["## Step 1: two plus three is five.", "## Step 2: five doubled is ten. \\boxed{10}"]


@pytest.fixture(scope="module")
def multi_server(pair):
    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    app = build_app(pair, **options)
    with running_server(app) as url:
        yield url, app, options
    app.state.runtime.close()  # (now, not at a later test's collection)


def test_models_are_listed_and_routed(multi_server):
    url, _, _ = multi_server
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["gen", "prm"]
    for model in ("gen", "prm"):
        resp = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 3},
                          timeout=60)
        assert resp.status_code == 200 and resp.json()["model"] == model
    assert httpx.post(f"{url}/v1/rewards", json={"model": "nope", "question": "q", "steps": ["a"]}).status_code == 404
    assert httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": "q", "steps": []}).status_code == 400
    too_long = httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": "q", "steps": ["seven " * 300]})
    assert too_long.status_code == 400 and "maximum model length" in too_long.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": "q", "steps": ["a"]}).status_code == 200


def _alongside_a_chat(url: str, chat_tokens: int, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """POSTs `body` to `path` while a chat completion of `chat_tokens` tokens runs on the generator."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            chat = client.post("/v1/chat/completions", json={
                "model": "gen", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": chat_tokens,
                "ignore_eos": True})
            return await asyncio.gather(chat, client.post(path, json=body))

    return asyncio.run(run())


def test_rewards_match_offline_runtime_while_generating(multi_server, pair):
    url, app, options = multi_server

    chat, reward = _alongside_a_chat(url, 40, "/v1/rewards", {"model": "prm", "question": QUESTION, "steps": STEPS})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 40
    body = reward.json()
    assert reward.status_code == 200 and len(body["scores"]) == 2 and body["recipe"] == "rlhflow"
    offline = Runtime(pair, **options).score_steps("prm", QUESTION, STEPS)
    assert body["scores"] == pytest.approx(offline, abs=1e-5)
    engines = app.state.engine.engines
    for engine in engines.values():
        wait_idle(engine)
    _assert_only_kept_blocks_held(engines)


def test_spaced_steps_score_the_same_offline_as_served(multi_server, pair):
    """The same steps, spaces and newlines around them, score the same through Runtime.score_steps as
    through /v1/rewards: one rule (runtime/scorer.py `given_steps`: stripped) for both (was: the
    server stripped them, the offline call scored them as sent: 0.80 against 0.26 here)."""
    url, _, options = multi_server
    spaced = ["  " + STEPS[0] + "\n\n", "\t" + STEPS[1] + " \n"]
    served = httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION, "steps": spaced}, timeout=60)
    assert served.status_code == 200, served.text
    rt = Runtime(pair, **options)
    try:
        assert rt.score_steps("prm", QUESTION, spaced) == pytest.approx(served.json()["scores"], abs=1e-5)
        assert rt.score_steps("prm", QUESTION, spaced) == pytest.approx(rt.score_steps("prm", QUESTION, STEPS),
                                                                       abs=1e-6)
    finally:
        rt.close()


def _assert_only_kept_blocks_held(engines):
    """No request holds blocks but the PRM's kept sequences, and every reference is accounted for."""
    from collections import Counter

    gen, prm = engines["gen"], engines["prm"]
    assert not gen.kv.block_tables
    kept = {request.request_id for request in prm.retained.values()}
    assert set(prm.kv.block_tables) == kept
    refs = Counter(b.block_id for e in engines.values() for t in e.kv.block_tables.values() for b in t)
    assert all(b.ref_count == refs[b.block_id] for b in gen.kv.pool.blocks)


def test_metrics_carry_the_model_label(multi_server):
    url, _, _ = multi_server
    text = httpx.get(f"{url}/metrics").text
    for model in ("gen", "prm"):
        assert f'treeserve:num_requests_running{{model_name="{model}"}}' in text
        assert f'treeserve:memory_weights_bytes{{model_name="{model}"}}' in text


SEARCH = {"model": "gen", "verifier": "prm", "question": QUESTION, "strategy": "beam", "n": 4, "beam_width": 2,
          "num_iterations": 2, "max_tokens": 6, "system_prompt": "", "seed": 3}


def test_search_answers_like_the_offline_runner_while_other_requests_flow(multi_server, pair):
    from treeserve.search.config import SearchConfig
    from treeserve.search.runner import SearchRunner

    url, app, options = multi_server

    chat, search = _alongside_a_chat(url, 30, "/v1/search", SEARCH)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 30
    body = search.json()
    assert search.status_code == 200, body
    assert body["strategy"] == "beam" and len(body["candidates"]) == 4 and body["tree_size"] > 0
    config = SearchConfig(strategy="beam", n=4, beam_width=2, num_iterations=2, max_tokens=6, system_prompt=None,
                          seed=3)
    rt = Runtime(pair, **options)
    offline = SearchRunner(rt.engine("gen"), rt.scorer("prm")).run([QUESTION], config)[0]
    assert [c["text"] for c in body["candidates"]] == offline.completions
    assert [c["score"] for c in body["candidates"]] == pytest.approx(offline.agg_scores, abs=1e-5)
    assert body["completion"] == offline.completions[offline.chosen]
    engines = app.state.engine.engines
    for engine in engines.values():
        wait_idle(engine)
    _assert_only_kept_blocks_held(engines)


@pytest.mark.parametrize("change, param", [({"verifier": None}, "verifier"), ({"n": 3, "strategy": "dvts"}, "beam_width"),
                                            ({"strategy": "mcts"}, "strategy"), ({"question": None}, "question"),
                                            ({"messages": [{"role": "system", "content": "x"}]}, "question"),
                                            ({"verifier": "nope"}, "model")])
def test_search_rejects_bad_input_naming_the_parameter(multi_server, change, param):
    url, _, _ = multi_server
    resp = httpx.post(f"{url}/v1/search", json={**SEARCH, **change}, timeout=60)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param
    assert httpx.post(f"{url}/v1/search", json=SEARCH, timeout=120).status_code == 200  # still serving


def _gauges(url: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("model_name", "")): s.value
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in family.samples}


def test_the_gauges_are_current_once_the_server_is_idle(multi_server):
    """After the last request, /metrics shows the engines as they are (nothing running, only the
    blocks the scorer keeps in use), without waiting for a later step to refresh it."""
    url, app, _ = multi_server
    assert httpx.post(f"{url}/v1/search", json=SEARCH, timeout=120).status_code == 200
    for steps in (STEPS, STEPS[:1], STEPS + ["## Step 3: so ten."]):
        assert httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION, "steps": steps}).status_code == 200
    with httpx.stream("POST", f"{url}/v1/search", json=dict(SEARCH, stream=True, seed=5), timeout=120) as cut:
        next(cut.iter_lines())  # the first event, then the client leaves: the search is cancelled
    engines = app.state.engine.engines
    deadline = time.monotonic() + 5
    while True:
        # (the cut search may still hand the PRM a last verdict after an engine first looks idle:
        # what is held is read again each time, with both engines idle)
        for engine in engines.values():
            wait_idle(engine)
        held = {name: e.kv.num_blocks_in_use() for name, e in engines.items()}
        gauges = _gauges(url)
        shown = {name: gauges[("treeserve:kv_blocks_in_use", name)] for name in engines}
        running = {name: gauges[("treeserve:num_requests_running", name)] for name in engines}
        if (shown == held and not any(running.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert shown == held and not any(running.values()), (shown, held, running)


def test_blocks_freed_between_steps_show_without_another_step(multi_server):
    """KV freed outside a step (here a job on the engine thread releasing a kept PRM sequence, as the
    scorer does when a verdict arrives with the last step) shows on /metrics while the engine idles."""
    url, app, _ = multi_server
    assert httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION, "steps": STEPS}).status_code == 200
    prm = app.state.engine.engines["prm"]
    wait_idle(prm)
    before = prm.kv.num_blocks_in_use()
    assert before > 0, "the PRM keeps no blocks: nothing to release"
    app.state.engine.post(prm.reclaim_one)
    deadline = time.monotonic() + 5
    while prm.kv.num_blocks_in_use() == before and time.monotonic() < deadline:
        time.sleep(0.01)
    held = prm.kv.num_blocks_in_use()
    assert held < before
    while _gauges(url)[("treeserve:kv_blocks_in_use", "prm")] != held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauges(url)[("treeserve:kv_blocks_in_use", "prm")] == held


def test_each_model_logs_engine_ready_once_with_its_final_kv_cache(pair, caplog):
    """A `Runtime` attaches KV twice (a dry run on scratch pages, then the arena it serves with):
    one "engine ready" line per model, with the arena's block count."""
    with caplog.at_level("INFO", logger="treeserve.engine.llm_engine"):
        app = build_app(pair, engine_thread=False, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
                        max_model_len=256)
    app.state.engine.shutdown()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    engines = app.state.engine.engines
    assert len(ready) == len(engines) == 2, ready
    for line, engine in zip(ready, engines.values()):
        assert f" {engine.kv.pool.num_blocks} KV blocks " in line, (line, engine.kv.pool.num_blocks)


def test_a_name_differing_from_a_served_one_by_builtin_is_hinted(multi_server):
    url, _, _ = multi_server
    body = {"prompt": "Hello", "max_tokens": 1}
    wrong = httpx.post(f"{url}/v1/completions", json={"model": "builtin:gen", **body}).json()["error"]
    assert wrong["message"] == "model: 'builtin:gen' does not exist; did you mean 'gen'? (served: gen, prm)"
    assert wrong["code"] == "model_not_found" and wrong["param"] == "model"
    other = httpx.post(f"{url}/v1/completions", json={"model": "nope", **body}).json()["error"]["message"]
    assert other == "model: 'nope' does not exist (served: gen, prm)"
    assert "did you mean 'builtin:arith-gen'?" in unknown_model("arith-gen", ["builtin:arith-gen"]).message


def test_a_prm_declaring_no_recipe_is_served_as_a_verifier_when_named(pair, tiny_model_dirs):
    """RLHFlow's PRMs declare nothing, so the operator names them: `--verifier NAME[=RECIPE]`. A plain
    model served alone and named a verifier answers /v1/rewards (before, a single model never did);
    unnamed, the same model is refused as one."""
    from treeserve.cli import build_parser
    from treeserve.server.launch import served_verifiers

    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    plain = str(tiny_model_dirs["qwen2"])
    for verifiers, status in (({"judge": None}, 200), ({}, 400)):
        app = build_app(plain, served_model_name="judge", verifiers=verifiers, **options)
        with running_server(app) as url:
            reward = httpx.post(f"{url}/v1/rewards", json={"model": "judge", "question": QUESTION, "steps": STEPS},
                                timeout=60)
            assert reward.status_code == status, reward.text
            if status == 200:
                assert reward.json()["recipe"] == "rlhflow" and len(reward.json()["scores"]) == 2
            chat = httpx.post(f"{url}/v1/completions", json={"model": "judge", "prompt": "Hi", "max_tokens": 2},
                              timeout=60)
            assert chat.status_code == 200  # a language model named a verifier still generates
        app.state.engine.shutdown()
    args = build_parser().parse_args(["serve", "--model", "gen=a", "--model", "prm=b", "--verifier", "prm=math-shepherd",
                                      "--verifier", "gen"])
    assert served_verifiers(args.verifier) == {"prm": "math-shepherd", "gen": None}
    with pytest.raises(ValueError, match="unknown recipe 'bogus'"):
        served_verifiers(["prm=bogus"])
    with pytest.raises(ValueError, match="--verifier nope: no served model has that name"):
        build_app(pair, verifiers={"nope": None}, **options)


def test_a_multi_model_app_keeps_its_runtime_open(pair, monkeypatch):
    """The Runtime that build_app makes for several models lives as long as the app (was: collected
    as build_app returned, its finalizer closed the served engines (a tensor-parallel Runtime's
    workers stopped, CUDA graphs dropped) and their reclaim callbacks, holding it weakly, freed no
    kept KV when the shared pool ran short)."""
    import gc

    from treeserve import SamplingParams
    from treeserve.engine.llm_engine import LLMEngine

    closed = []
    monkeypatch.setattr(LLMEngine, "close", lambda engine: closed.append(engine))
    app = build_app(pair, engine_thread=False, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
                    max_model_len=256)
    try:
        gc.collect()
        loop = app.state.engine.loop
        assert not [e for e in closed if any(e is served for served in loop.engines)]  # (others: earlier tests')
        prm = next(e for e in loop.engines if e.name == "prm")
        done = []
        loop.add_request(prm, "kept", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), done.append,
                         logits_positions=[4], keep_kv=True)
        loop.run_until(lambda: bool(done) and done[-1].finished)
        assert prm.retained.num_blocks() > 0
        assert prm.scheduler.reclaim() and prm.retained.num_blocks() == 0  # (the pool's way to free kept KV)
    finally:
        app.state.runtime.close()
