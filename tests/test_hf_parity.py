"""Logits, greedy tokens and logprobs against HF transformers on random tiny models of every family,
on the CPU and, where there is one, on a CUDA device (HF then runs on that device too)."""
import pytest
import torch
import transformers

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.model.random_models import make_tiny_model
from treeserve.testing.tiny_models import FAMILIES

PROMPTS = [
    "The water is",
    "Hello",
    "A long time ago in a place far away there was one old man who had a small boat and",
    "café 日本語 😀 number 42",
    "Step 1: add the two numbers",
    "They said that every good answer needs",
    "x",
    "Many people write about how to make the best use of their time when they are at home, "
    "because there is water to read and a hand to give",
]
MAX_TOKENS = 24


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _hf_model(path, device):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module", params=[(f, d) for d in DEVICES for f in FAMILIES], ids="-".join)
def family_setup(request, tiny_model_dirs):
    family, device = request.param
    path = tiny_model_dirs[family]
    llm = LLM(str(path), dtype="float32", device=device, kv_cache_memory_bytes=8 << 20)
    return family, llm, _hf_model(path, device)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids], device=hf.device)).logits[0].float().cpu()


def test_prompt_logits_match_hf(family_setup):
    family, llm, hf = family_setup
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        engine.add_request(f"logits-{i}", ids, SamplingParams(), logits_positions=list(range(len(ids))))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        ours = torch.stack([outputs[f"logits-{i}"].prompt_logits[p].cpu() for p in range(len(ids))])
        ref = _hf_logits(hf, ids)
        assert _relative_error(ours, ref) < 1e-4, (family, prompt)
    assert_no_leak(engine)


def _hf_greedy(hf, ids, max_new_tokens):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids], device=hf.device),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=hf.device),
                          do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          pad_token_id=hf.config.pad_token_id)
    return out[0, len(ids):].tolist()


def check_64_tokens_with_chunked_prefill_and_a_prefix_hit(path, family: str, min_prompt: int = 16) -> None:
    """64 greedy tokens of two prompts longer than `min_prompt` tokens (and than one 16-token chunk),
    twice (the second run hits the prefix cache): HF's tokens, logprobs within 1e-4, no leak."""
    hf = _hf_model(path, "cpu")
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64, logprobs=1)
    prompts = [PROMPTS[2], PROMPTS[7]]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again):
        assert b.num_cached_tokens > 0 and a.outputs[0].token_ids == b.outputs[0].token_ids
        ids = a.prompt_token_ids
        assert len(ids) > max(min_prompt, 16)
        tokens = a.outputs[0].token_ids
        assert tokens == _hf_greedy(hf, ids, 64), family
        ref = torch.log_softmax(_hf_logits(hf, ids + tokens), dim=-1)
        for step, (token, entry) in enumerate(zip(tokens, a.outputs[0].logprobs)):
            assert abs(entry[token].logprob - float(ref[len(ids) - 1 + step][token])) < 1e-4, family
    assert_no_leak(llm.engine)


def test_greedy_batch_matches_hf_generate(family_setup):
    family, llm, hf = family_setup
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = output.prompt_token_ids
        completion = output.outputs[0]
        assert completion.token_ids == _hf_greedy(hf, ids, MAX_TOKENS), (family, prompt)
        assert completion.finish_reason == "length"
        ref_logits = _hf_logits(hf, ids + completion.token_ids)
        ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            ref = ref_logprobs[len(ids) - 1 + step]
            assert abs(entry[token].logprob - float(ref[token])) < 1e-4
            assert entry[token].rank == int((ref > ref[token]).sum()) + 1  # EOS is masked, so not always 1
            top3 = ref.topk(3).indices.tolist()
            assert set(top3) <= set(entry)
            for tid in top3:
                assert abs(entry[tid].logprob - float(ref[tid])) < 1e-4
    assert_no_leak(llm.engine)


def test_a_prompt_longer_than_4096_tokens_matches_hf(tmp_path):
    """5,000 prompt tokens in chunks of 1,200: the last chunks attend over cached prefixes longer
    than one prefix segment (4,096 tokens); every 50th prompt position's logits and 8 greedy tokens
    as HF's, no leak."""
    path = make_tiny_model("llama", tmp_path / "long", seed=3, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=8192)
    ids = torch.randint(3, 500, (5000,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=1200)
    positions = list(range(0, len(ids), 50)) + [len(ids) - 1]
    llm.engine.add_request("long", ids, SamplingParams(), logits_positions=positions)
    finished = None
    while llm.engine.has_unfinished_requests():
        finished = next((out for out in llm.engine.step() if out.finished), finished)
    hf = _hf_model(path, "cpu")
    ours = torch.stack([finished.prompt_logits[p].cpu() for p in positions])
    assert _relative_error(ours, _hf_logits(hf, ids)[positions]) < 1e-4
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    [greedy] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert greedy.outputs[0].token_ids == _hf_greedy(hf, ids, 8)
    assert_no_leak(llm.engine)
