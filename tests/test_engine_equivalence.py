"""The same greedy tokens whatever the batching: chunked prefill, preemption, prefix-cache hits, forks."""
import pytest

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.engine.model_runner import kv_bytes_per_block

PROMPTS = [
    "The water is",
    "Hello there, how are you",
    "A long time ago in a place far away there was one old man who had a small boat and he",
    "café 日本語 😀 number 42",
    "Step 1: add the two numbers and write the sum",
    "They said that every good answer needs",
    "x",
    "Many people write about how to make the best use of their time",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _llm(path, **options):
    options.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(str(path), dtype="float32", device="cpu", **options)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = _llm(llama_dir, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_chunked_prefill_gives_identical_tokens(llama_dir, reference):
    llm = _llm(llama_dir, max_num_batched_tokens=7)
    steps = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        steps.append(out)
        return out

    llm.engine.scheduler.schedule = spy
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert max(s.num_tokens for s in steps) <= 7
    mixed = [s for s in steps if {x.num_new_tokens == 1 for x in s.scheduled} == {True, False}]
    assert mixed, "expected steps that mix prefill chunks with decodes"
    assert_no_leak(llm.engine)


def test_preemption_gives_identical_tokens(llama_dir, reference):
    probe = _llm(llama_dir)
    per_block = kv_bytes_per_block(probe.engine.model, 16, probe.engine.dtype)
    llm = _llm(llama_dir, kv_cache_memory_bytes=per_block * 8, max_model_len=128)
    assert llm.engine.kv.pool.num_blocks == 8
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm.engine)


def test_decode_groups_capped_by_keys_give_identical_tokens(llama_dir, reference):
    llm = _llm(llama_dir)
    runner = llm.engine.runner
    runner.decode_group_max_keys = 48  # at most three blocks of keys: a group of one or two
    groups = []
    original = runner.prepare_inputs

    def spy(scheduled):
        inputs = original(scheduled)
        groups.extend(inputs.meta.decode_groups)
        return inputs

    runner.prepare_inputs = spy
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    rows = [g.block_tables.shape[0] for g in groups]
    assert all(r == 1 or r * g.block_tables.shape[1] * 16 <= 48 for r, g in zip(rows, groups))
    assert max(rows) > 1 and 1 in rows, "expected groups of one and of more than one"
    assert_no_leak(llm.engine)


def test_prefix_cache_hit_gives_identical_tokens(llama_dir, reference):
    llm = _llm(llama_dir)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats_before = llm.engine.kv.pool.stats.snapshot()
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.engine.kv.pool.stats
    assert _tokens(first) == reference and _tokens(second) == reference
    assert stats.hits > stats_before.hits
    assert any(o.num_cached_tokens > 0 for o in second)
    assert all(o.num_cached_tokens == 0 for o in first)
    assert_no_leak(llm.engine)


def test_requests_sharing_an_uncached_prefix_compute_it_once(llama_dir):
    """Submitted together, requests with a common prefix do not all compute it in the same step."""
    shared = PROMPTS[2] + " " + PROMPTS[7]
    prompts = [f"{shared} {tail}" for tail in ("one", "two more", "and three", "four")]
    expected = _tokens(_llm(llama_dir, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(llama_dir)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    block_size = llm.engine.kv.block_size
    shared_blocks = len(llm.get_tokenizer().encode(shared)) // block_size - 1
    assert shared_blocks >= 2
    assert all(o.num_cached_tokens >= shared_blocks * block_size for o in outputs[1:])
    assert_no_leak(llm.engine)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llama_dir):
    llm = _llm(llama_dir)
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone_1 = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    alone_2 = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(PROMPTS, [params if i == 2 else others for i in range(len(PROMPTS))], use_tqdm=False)
    samples = [c.token_ids for c in alone_1.outputs]
    assert len(samples) == 4
    assert samples == [c.token_ids for c in alone_2.outputs]
    assert samples == [c.token_ids for c in batch[2].outputs]
    assert len({tuple(s) for s in samples}) > 1, "the n samples should differ from each other"
    assert_no_leak(llm.engine)


def test_n_greater_than_one_prefills_the_prompt_once(llama_dir):
    llm = _llm(llama_dir, enable_prefix_caching=False)
    counted = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        counted.append(out.num_tokens)
        return out

    llm.engine.scheduler.schedule = spy
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    # prompt[:-1] once, then each of the 4 forks computes the last prompt token and 9 generated ones
    assert sum(counted) == (len(prompt_ids) - 1) + 4 * 10
    assert_no_leak(llm.engine)


def test_forks_report_the_prefix_they_found_cached(llama_dir):
    llm = _llm(llama_dir)
    llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)
    again = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    block_size, prompt_len = llm.engine.kv.block_size, len(llm.get_tokenizer().encode(PROMPTS[2]))
    assert prompt_len > block_size + 1
    assert block_size <= again.num_cached_tokens < prompt_len and again.num_cached_tokens % block_size == 0
    assert_no_leak(llm.engine)


def test_n_forks_match_independent_seeded_requests(llama_dir):
    llm = _llm(llama_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    forked = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    singles = [llm.generate(PROMPTS[0], params.clone(n=1, seed=99 + i), use_tqdm=False)[0] for i in range(3)]
    assert [c.token_ids for c in forked.outputs] == [s.outputs[0].token_ids for s in singles]
    assert_no_leak(llm.engine)


def test_abort_frees_blocks(llama_dir):
    llm = _llm(llama_dir)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    engine.add_request("a", tokenizer.encode(PROMPTS[2]), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", tokenizer.encode(PROMPTS[3]), SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_blocks_in_use() > 0
    engine.abort_request("a")
    engine.abort_request("b")
    assert_no_leak(engine)
    assert _tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
