"""prefix_cache_queries / prefix_cache_hits counted as vLLM V1 counts them (vllm/v1/core/kv_cache_manager.py,
get_computed_blocks): each request's prompt tokens once, at its first lookup, and the tokens found; a request
with n samples is n requests there, each looking its prompt up. Block size 16 here."""
from treeserve import LLM, SamplingParams

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)


def _counts(llm) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.prefix_queries, stats.prefix_hits


def _moved(llm, prompt: list[int], n: int) -> tuple[int, int]:
    before = _counts(llm)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, n=n, ignore_eos=True), use_tqdm=False)
    after = _counts(llm)
    return after[0] - before[0], after[1] - before[1]


def test_each_sample_queries_its_whole_prompt_and_reuses_what_the_shared_prefill_computed(tiny_model_dirs):
    """n=2 over a 5-token prompt queried 4 tokens (the shared prefill's lookup of all but the last) where
    vLLM's two child requests query 10. The second sample computes only the last prompt token: the 4
    others are shared from the prefill (a fork shares the partly filled block too, which vLLM's second
    child, finding full blocks only, recomputes)."""
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    assert llm.engine.stats().block_size == 16
    assert _moved(llm, list(range(3, 8)), n=2) == (10, 4)


def test_a_repeated_prompt_hits_its_full_blocks_and_n_samples_count_n_prompts(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    prompt = list(range(3, 43))  # 40 tokens: two full blocks and 8 more
    assert _moved(llm, prompt, n=1) == (40, 0)
    assert _moved(llm, prompt, n=1) == (40, 32)  # its two full blocks
    # three samples: the shared prefill finds the two blocks (sample 1: 32 of 40), samples 2 and 3 share
    # the prefill's 39 tokens and compute the last
    assert _moved(llm, prompt, n=3) == (120, 32 + 2 * 39)


def test_a_preempted_request_recomputing_is_not_queried_again(tiny_model_dirs):
    """vLLM counts a preempted request's new lookup apart (PrefixCacheStats.preempted_queries), not in
    prefix_cache_queries; here it counted its prompt and generated tokens again at each recompute."""
    from treeserve.engine.model_runner import kv_bytes_per_block

    probe = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    per_block = kv_bytes_per_block(probe.engine.model, 16, probe.engine.dtype)
    llm = LLM(str(tiny_model_dirs["llama"]), **{**OPTIONS, "kv_cache_memory_bytes": per_block * 8,
                                                 "max_model_len": 128})
    prompts = [list(range(3 + i, 10 + i)) for i in range(8)]  # distinct 7-token prompts: no full block
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _counts(llm) == (sum(map(len, prompts)), 0)
