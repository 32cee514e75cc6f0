"""Phi-3 (fused qkv and gate/up projections as shipped, LongRoPE) against HF transformers on a random
tiny model whose original length is 48 positions: prompts on both sides of it, chunked prefill,
a prefix-cache hit, and 64 generated tokens that cross it (HF switches to the long factors from
the first forward pass past it; so must we)."""
import pytest
import torch

from conftest import assert_no_leak
from test_hf_parity import PROMPTS, _hf_greedy, _hf_logits, _hf_model, _relative_error
from treeserve import LLM, SamplingParams
from treeserve.model.random_models import PHI3_ORIGINAL_POSITIONS
from treeserve.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = make_tiny_model("phi3", tmp_path_factory.mktemp("phi3") / "phi3", seed=4)
    return path, _hf_model(path, "cpu")


def _prompts(tokenizer):
    short = tokenizer.encode(PROMPTS[0])
    long = tokenizer.encode(" ".join(PROMPTS[2:]))
    assert len(short) < PHI3_ORIGINAL_POSITIONS < len(long)
    return [short, long]


def test_prompt_logits_on_both_sides_of_the_original_length(phi3):
    path, hf = phi3
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    engine = llm.engine
    prompts = _prompts(llm.get_tokenizer())
    for i, ids in enumerate(prompts):
        engine.add_request(f"logits-{i}", ids, SamplingParams(), logits_positions=list(range(len(ids))))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    for i, ids in enumerate(prompts):  # the long one in chunks of 16: the long factors from its first chunk
        ours = torch.stack([outputs[f"logits-{i}"].prompt_logits[p] for p in range(len(ids))])
        assert _relative_error(ours, _hf_logits(hf, ids)) < 1e-4, i
    assert_no_leak(engine)


def test_64_tokens_past_the_original_length_with_a_prefix_hit(phi3):
    """A long prompt: every pass is past the original length, in HF as here. Its prefix, cached
    first by a prompt short enough for the short factors, is not reused (its keys were rotated
    with the other factors); its own blocks are, the second time."""
    path, hf = phi3
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    short, long = _prompts(llm.get_tokenizer())
    prefix = long[:40]  # fills two 16-token blocks, within the original length
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64, logprobs=1)
    first_short = llm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert first_short.num_cached_tokens == 0
    first = llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    tokens = first.outputs[0].token_ids
    assert again.outputs[0].token_ids == tokens == _hf_greedy(hf, long, 64)
    ref = torch.log_softmax(_hf_logits(hf, long + tokens), dim=-1)
    for step, (token, entry) in enumerate(zip(tokens, first.outputs[0].logprobs)):
        assert abs(entry[token].logprob - float(ref[len(long) - 1 + step][token])) < 1e-4
    assert_no_leak(llm.engine)


def test_a_short_prompt_within_the_original_length_matches(phi3):
    """Prompt and output within the original length: the short factors throughout. (Past it, HF
    drops its cache once and recomputes every key with the long factors; treeserve, like vLLM,
    keeps the keys it has and rotates the tokens after with the long ones.)"""
    path, hf = phi3
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    short = _prompts(llm.get_tokenizer())[0]
    count = PHI3_ORIGINAL_POSITIONS - len(short)
    out = llm.generate([{"prompt_token_ids": short}], SamplingParams(temperature=0.0, max_tokens=count,
                                                                      min_tokens=count), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf, short, count)


def test_a_kept_sequence_is_not_extended_across_the_regimes(phi3):
    """A verifier's kept conversation within the original length, extended past it: the extension
    is computed afresh with the long factors, not forked from keys rotated with the short ones."""
    path, hf = phi3
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    engine = llm.engine
    long = _prompts(llm.get_tokenizer())[1]
    short = long[:40]
    outputs = {}
    engine.add_request("kept", short, SamplingParams(max_tokens=1), logits_positions=[len(short) - 1], keep_kv=True)
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.retained.parent("kept", long) is not None  # kept, and the long prompt extends it
    engine.add_request("extended", long, SamplingParams(max_tokens=1), logits_positions=list(range(len(long))),
                       parent_id="kept")
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    ours = torch.stack([outputs["extended"].prompt_logits[p] for p in range(len(long))])
    assert _relative_error(ours, _hf_logits(hf, long)) < 1e-4
    engine.release_kv("kept")
    assert_no_leak(engine)
