"""Prompt logprobs against HF transformers' log-softmax on random tiny models of every family:
whole prefills, chunked prefills, a cached prefix, n > 1 (the shared prefill computes them)."""
import pytest
import torch
import transformers

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.engine import prompt_logprobs
from treeserve.testing.tiny_models import FAMILIES

PROMPTS = [
    "A long time ago in a place far away there was one old man who had a small boat and",
    "café 日本語 😀 number 42",
    "Many people write about how to make the best use of their time when they are at home, "
    "because there is water to read and a hand to give",
]
TOP = 3


def _hf_logprobs(path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(entries, ids: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        row, token = ref[pos - 1], ids[pos]
        entry = entries[pos]
        assert abs(entry[token].logprob - float(row[token])) < 1e-4, pos
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_lp, top_ids = row.topk(TOP)
        for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
            assert abs(entry[tid].logprob - lp) < 1e-4
            if tid != token:
                assert entry[tid].rank == rank
        assert set(entry) <= set(top_ids.tolist()) | {token}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_model_dirs):
    path = tiny_model_dirs[request.param]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return path, ids, [_hf_logprobs(path, i) for i in ids]


@pytest.mark.parametrize("budget", [2048, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf(family, budget):
    path, prompts, refs = family
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=budget)
    params = SamplingParams(prompt_logprobs=TOP, max_tokens=2, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for out, ids, ref in zip(outputs, prompts, refs):
        _check(out.prompt_logprobs, ids, ref)
        assert len(out.outputs[0].token_ids) == 2
    assert_no_leak(llm.engine)


def test_a_cached_prefix_still_gets_its_logprobs(family):
    path, prompts, refs = family
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, block_size=4)
    ids = prompts[2]
    first = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    again = llm.generate([{"prompt_token_ids": ids}], SamplingParams(prompt_logprobs=TOP, max_tokens=1),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # computed afresh: the cached blocks hold KV, not logits
    _check(again.prompt_logprobs, ids, refs[2])
    after = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert after.num_cached_tokens > 0  # what it computed is cached for the requests after it
    assert_no_leak(llm.engine)


def test_n_samples_share_one_prompt_computation(family, monkeypatch):
    path, prompts, refs = family
    monkeypatch.setattr(prompt_logprobs, "SLICE_ELEMENTS", 1)  # one row of logits at a time
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    out = llm.generate([{"prompt_token_ids": prompts[0]}],
                       SamplingParams(n=3, prompt_logprobs=TOP, max_tokens=3, seed=1), use_tqdm=False)[0]
    _check(out.prompt_logprobs, prompts[0], refs[0])
    assert len(out.outputs) == 3
    assert llm.engine.num_tokens_computed == len(prompts[0]) - 1 + 3 * 3  # the prompt once, then 3 x 3 tokens
    assert_no_leak(llm.engine)


def test_zero_asks_for_the_prompt_tokens_own_logprobs_only(family):
    path, prompts, refs = family
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(prompt_logprobs=0, max_tokens=1),
                       use_tqdm=False)[0]
    assert all(len(entry) == 1 and prompts[1][pos] in entry for pos, entry in enumerate(out.prompt_logprobs) if pos)
