"""Tensor parallelism on CPU (gloo; two ranks: this process and one worker process) against one rank:
the same greedy tokens and logprobs within 1e-4 on the tiny models whose weights shard differently
(llama3, qwen2, gemma3; plain Llama, Mistral and Qwen3 shard as these do and are not run, see the
comment above the test), one with a single K/V head (replicated) and one whose vocabulary is odd;
with chunked prefill, prefix-cache hits, n > 1, prompt logprobs and structured outputs; a Runtime's
search; each rank's share of the weights; a worker with a cold kernel cache; a worker killed, and one
hung, mid-run."""
import json
import os
import signal
import time

import pytest

from conftest import assert_no_leak
from treeserve import LLM, Runtime, SamplingParams
from treeserve.engine.tp_executor import WorkerDiedError
from treeserve.sampling_params import StructuredOutputsParams
from treeserve.search.config import SearchConfig
from treeserve.search.runner import SearchRunner
from treeserve.testing.tiny_models import FAMILIES, make_tiny_model

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=24)
TP2 = dict(tensor_parallel_size=2, threads_per_rank=1)
PROMPTS = ["The water is", "A long time ago in a place far away there was one old man who had a small boat and",
           "café 日本語 😀 number 42", "Step 1: add the two numbers", "x"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def _params():
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3, prompt_logprobs=2),
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, tiny_model_dirs):
    root = tmp_path_factory.mktemp("tp-models")
    models = {family: tiny_model_dirs[family] for family in FAMILIES}
    models["one-kv-head"] = make_tiny_model("llama", root / "one-kv-head", seed=3, num_key_value_heads=1)
    models["odd-vocab"] = make_tiny_model("qwen2", root / "odd-vocab", seed=4, vocab_size=515)
    models["gemma3"] = make_tiny_model("gemma3", root / "gemma3", seed=3)
    return models


def _generate(path, **extra):
    """The workload twice (the second run hits the prefix cache), and how many tokens it found cached."""
    with LLM(str(path), **OPTIONS, **extra) as llm:
        first = llm.generate(PROMPTS, _params(), use_tqdm=False)
        second = llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert_no_leak(llm.engine)
    return first + second, sum(o.num_cached_tokens for o in second)


def _close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-4


def _assert_same(ours, ref):
    assert len(ours) == len(ref), (len(ours), len(ref))  # zip below would stop at the shorter
    for x, y in zip(ours, ref):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs], x.prompt
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
        for cx, cy in zip(x.outputs, y.outputs):
            assert len(cx.logprobs or []) == len(cy.logprobs or []), x.prompt
            for ex, ey in zip(cx.logprobs or [], cy.logprobs or []):
                assert set(ex) == set(ey) and all(_close(ex[t].logprob, ey[t].logprob) for t in ex)
        assert len(x.prompt_logprobs or []) == len(y.prompt_logprobs or []), x.prompt
        for ex, ey in zip(x.prompt_logprobs or [], y.prompt_logprobs or []):
            assert (ex is None) == (ey is None)
            assert ex is None or all(_close(ex[t].logprob, ey[t].logprob) for t in ey if t in ex)


# every family's own sharding switch: qkv bias (qwen2), attention and MLP biases with tied embeddings
# (llama3), q/k norm with Gemma's (1 + w) norms around attention and the MLP and a local RoPE
# (gemma3; Qwen3's q/k norm shards as its does); plain Llama and Mistral shard as "one-kv-head" and
# llama3 do (their sliding window is no sharding matter), dropped to keep the suite within its 15 minutes
@pytest.mark.parametrize("name", ["llama3", "qwen2", "gemma3", "one-kv-head", "odd-vocab"])
def test_two_ranks_give_one_ranks_tokens_and_logprobs(tp_models, name):
    ref, ref_cached = _generate(tp_models[name])
    ours, cached = _generate(tp_models[name], **TP2)
    _assert_same(ours, ref)
    assert cached == ref_cached > 0, "the second run should hit the prefix cache"
    constrained = ours[2].outputs[0]  # the grammar held across ranks
    assert constrained.text.startswith('{"n":')
    if constrained.finish_reason == "stop":
        assert isinstance(json.loads(constrained.text)["n"], int)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_two_ranks_speculating_give_one_ranks_tokens_and_logprobs(tp_models, method):
    """The drafts travel in the step to every rank; each rank runs their rows; rank 0 verifies.
    A draft model runs whole on rank 0 (here the target itself, unsharded), its KV in rank 0's pages."""
    ref, _ = _generate(tp_models["llama3"])
    speculating = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1} if method == "ngram" \
        else {"method": "draft_model", "model": str(tp_models["llama3"]), "num_speculative_tokens": 4}
    with LLM(str(tp_models["llama3"]), **OPTIONS, **TP2, speculative_config=speculating) as llm:
        ours = llm.generate(PROMPTS, _params(), use_tqdm=False) + llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert llm.engine.stats().spec_decode_num_drafts > 0
        assert_no_leak(llm.engine)
    _assert_same(ours, ref)


def test_an_eagle_head_with_two_ranks_is_refused_by_name(tp_models, tmp_path):
    from treeserve.errors import ParamError
    from treeserve.testing.tiny_models import make_tiny_eagle_head

    head = make_tiny_eagle_head("eagle", tp_models["llama3"], tmp_path / "head")
    with pytest.raises(ParamError, match="'eagle' with tensor parallelism is not supported yet"):
        LLM(str(tp_models["llama3"]), **OPTIONS, **TP2, speculative_config={"method": "eagle", "model": str(head)})


def test_a_runtime_searches_alike_at_two_ranks(tmp_path):
    steps = {"\n": 5.4, "<|eos|>": 0.5}
    pair = {"gen": str(make_tiny_model("llama", tmp_path / "gen", seed=5, favour_tokens=steps)),
            "prm": str(make_tiny_model("qwen2", tmp_path / "prm", seed=6, hidden_size=96, num_hidden_layers=3,
                                       prm_recipe="rlhflow"))}
    config = SearchConfig(strategy="beam", n=4, beam_width=2, num_iterations=3, max_tokens=24, temperature=1.0,
                          system_prompt="Solve it.", seed=3)
    questions = ["What is 2 + 3?", "Double seven, then add one."]

    def search(**extra):
        rt = Runtime(pair, dtype="float32", device="cpu", max_model_len=384, max_num_batched_tokens=384,
                     kv_cache_memory_bytes=8 << 20, **extra)
        try:
            return SearchRunner(rt.engine("gen"), rt.scorer("prm")).run(questions, config)
        finally:
            rt.close()

    one, two = search(), search(**TP2)
    assert [r.completions for r in two] == [r.completions for r in one]
    for x, y in zip(two, one):
        assert x.chosen == y.chosen
        assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(x.scores, y.scores))


def test_each_rank_holds_about_half_of_the_weights(tp_models):
    from treeserve.engine.tp_worker import resident_bytes

    path = tp_models["llama3"]
    with LLM(str(path), **OPTIONS) as whole:
        full = resident_bytes(whole.engine.model)
    with LLM(str(path), **OPTIONS, **TP2) as llm:
        ranks = [resident_bytes(llm.engine.model)] + [report["model"] for report in llm.engine.executor.report()]
    print(f"resident weights: one rank {full:,} bytes; two ranks {ranks} ({[round(r / full, 3) for r in ranks]})")
    assert all(0.4 < r / full < 0.6 for r in ranks)


def test_a_worker_with_a_cold_kernel_cache_builds_before_the_first_step(tp_models, tmp_path, monkeypatch):
    """Rank 0 has the CPU kernels loaded; the worker finds an empty cache and a compiler slower than
    the collectives' timeout. Built inside its first step, it would keep rank 0 waiting in an
    all-reduce until the engine failed; built while loading the model, the run is the one rank's."""
    from treeserve.engine.tp_worker import COLLECTIVE_TIMEOUT_S
    from treeserve.model import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("hardware: no C compiler, so no CPU kernels to build")
    slow_cc = tmp_path / "slow-cc"
    slow_cc.write_text(f'#!/bin/sh\ncase "$1" in --version) exec cc "$@";; esac\n'
                       f'sleep {COLLECTIVE_TIMEOUT_S + 2:.0f}\nexec cc "$@"\n')
    slow_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(slow_cc))
    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path / "cold-cache"))  # the worker's, not rank 0's (cached)
    path, params = tp_models["llama3"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = []
    for extra in ({}, TP2):
        with LLM(str(path), **OPTIONS, **extra) as llm:
            runs.append(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    _assert_same(runs[1], runs[0])
    assert list((tmp_path / "cold-cache" / "kernels").glob("*/libtreeserve_cpu.so")), "the worker built nothing"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_a_killed_worker_fails_the_engine_naming_its_rank(tp_models):
    llm = LLM(str(tp_models["llama"]), **OPTIONS, **TP2)
    pids = llm.engine.executor.pids()
    engine = llm.engine
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    llm.loop.step()
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1") as failure:
        while engine.has_unfinished_requests():
            llm.loop.step()
    assert time.monotonic() - start < 10
    assert failure.value.rank == 1
    with pytest.raises(WorkerDiedError):
        llm.loop.step()  # it stays failed
    llm.close()
    assert not any(_alive(pid) for pid in pids)


def test_a_hung_worker_fails_the_engine_naming_its_rank(tp_models):
    llm = LLM(str(tp_models["llama"]), **OPTIONS, **TP2)
    pid = llm.engine.executor.pids()[0]
    engine = llm.engine
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    llm.loop.step()
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerDiedError, match="rank 1 stopped answering"):
            while engine.has_unfinished_requests():
                llm.loop.step()
        assert time.monotonic() - start < 10
    finally:
        os.kill(pid, signal.SIGCONT)
        llm.close()
    assert not _alive(pid)
