"""The server with `speculative_config` (what `--speculative-config` gives): the OpenAI conformance
tests of test_server_openai run against it unchanged, drafts are verified while they run, and
vLLM's spec-decode counters appear on /metrics."""
from contextlib import contextmanager

import httpx
import pytest

from conftest import API_KEY, running_server, wait_idle
from test_server_openai import *  # noqa: F401,F403  (the conformance tests, run here with speculation)
from test_spec_decode import price_nothing
from treeserve.bench.telemetry import parse_prometheus

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle3"])
def server(llama_dir, request, tmp_path_factory):
    """The tiny Llama served as 'tiny', speculating with n-gram drafts, then with a draft model
    (itself: every draft kept, so whole drafts run through each route), then a random EAGLE-3 head."""
    from types import SimpleNamespace

    from treeserve.server.launch import build_app
    from treeserve.testing.tiny_models import make_tiny_eagle_head

    speculative = {"ngram": NGRAM, "draft_model": {"method": "draft_model", "model": str(llama_dir)},
                   "eagle3": {"method": "eagle3", "model": str(make_tiny_eagle_head(
                       "eagle3", llama_dir, tmp_path_factory.mktemp("head")))}}[request.param]
    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], max_queue=1000, dtype="float32",
                    device="cpu", kv_cache_memory_bytes=32 << 20, max_model_len=512, speculative_config=speculative)
    with running_server(app) as url:
        yield SimpleNamespace(url=url, app=app, async_engine=app.state.engine, engine=app.state.engine.engine,
                              key=API_KEY)


def test_drafts_were_verified_and_counted_on_metrics(server):
    before = parse_prometheus(httpx.get(f"{server.url}/metrics", headers=AUTH).text)
    body = {"model": "tiny", "prompt": "one two three one two three one two", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    with drafting_always(server.engine.speculator):
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
        wait_idle(server.engine)
    after = parse_prometheus(httpx.get(f"{server.url}/metrics", headers=AUTH).text)
    label = '{model_name="tiny"}'
    names = [f"treeserve:spec_decode_num_{what}_total{label}" for what in ("drafts", "draft_tokens", "accepted_tokens")]
    drafts, draft_tokens, accepted = (after[n] - before.get(n, 0) for n in names)
    assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    stats = server.engine.stats()
    assert after[names[2]] == stats.spec_decode_num_accepted_tokens
    per_position = {k: v for k, v in after.items() if k.startswith("treeserve:spec_decode_num_accepted_tokens_per_pos")}
    assert sum(per_position.values()) == stats.spec_decode_num_accepted_tokens
    assert server.engine.kv.num_blocks_in_use() == 0
    assert server.engine.kv.pool.num_free == server.engine.kv.pool.num_blocks  # the draft model's KV too


def test_a_bad_speculative_config_is_refused_by_name(llama_dir):
    from treeserve.server.launch import build_app

    with pytest.raises(ValueError, match="speculative_config: method 'medusa' is not supported by treeserve yet"):
        build_app(str(llama_dir), dtype="float32", device="cpu", speculative_config={"method": "medusa"})


def test_a_search_may_not_make_the_server_load_a_draft_model(server, tmp_path):
    body = {"model": "tiny", "question": "Add two and three.", "strategy": "greedy", "max_tokens": 4,
            "speculative_config": {"method": "draft_model", "model": str(tmp_path)}}
    reply = httpx.post(f"{server.url}/v1/search", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "may not load a model" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "speculative_config"


def test_a_greedy_search_says_it_wrote_one_candidate(server):
    body = {"model": "tiny", "question": "Add two and three.", "strategy": "greedy", "max_tokens": 4}
    reply = httpx.post(f"{server.url}/v1/search", json=body, headers=AUTH, timeout=60).json()
    assert reply["n"] == 1 == len(reply["candidates"]), reply  # (it said n 4, the request's default)


def test_each_reply_reports_its_own_drafts_and_treeserve_bench_reads_them(server, tmp_path):
    """usage.completion_tokens_details' accepted_/rejected_prediction_tokens (OpenAI's fields for
    predicted tokens) carry the request's own speculation, streamed or not; `treeserve bench` records
    them per request and summarises their spread beside the server's counters."""
    with drafting_always(server.engine.speculator):
        _each_reply_reports_its_drafts(server, tmp_path)


def _each_reply_reports_its_drafts(server, tmp_path):
    import json

    from openai import OpenAI

    from treeserve.bench.run import BenchConfig, run_benchmark

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    kwargs = dict(model="tiny", prompt="one two three one two three one two", max_tokens=48, temperature=0,
                  extra_body={"ignore_eos": True})
    details = client.completions.create(**kwargs).usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0 and details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    streamed = usage.completion_tokens_details  # (how far a request drafts follows the measured costs: not equal)
    assert streamed.accepted_prediction_tokens + streamed.rejected_prediction_tokens > 0
    config = BenchConfig(base_url=server.url, api_key=API_KEY, model="tiny", out=str(tmp_path), input_len=[24],
                         output_len=[32], concurrency=[4], num_requests=8, plots=False, vocab_size=200)
    level = run_benchmark(config)["levels"][0]
    assert level["completed"] == 8
    rates = level["spec_decode"]["request_acceptance_rate"]
    assert rates["count"] >= 1 and 0 <= rates["p10"] <= rates["median"] <= rates["p90"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert any(row["accepted_draft_tokens"] is not None for row in rows)


@contextmanager
def drafting_always(speculator):
    """Drafts at every step, whatever rows and passes cost (the module's server serves the other
    tests with its measured costs again afterwards)."""
    proposer = speculator.proposers[speculator.config]
    measured = proposer.pass_costs
    price_nothing(speculator)
    try:
        yield
    finally:
        del speculator.costs.keep_threshold
        proposer.pass_costs = measured
