"""Mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert and a dense layer,
Qwen3-MoE) against HF transformers on random tiny models: test_hf_parity's logits and greedy
tests, and 64 greedy tokens with chunked prefill and a prefix-cache hit."""
import pytest
import torch

from conftest import assert_no_leak
import test_hf_parity
from test_hf_parity import PROMPTS, _hf_greedy, _hf_logits, _hf_model, test_prompt_logits_match_hf  # noqa: F401
from treeserve import LLM, SamplingParams
from treeserve.testing.tiny_models import MOE_FAMILIES, make_tiny_model


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-models")
    return {family: make_tiny_model(family, root / family, seed=2) for family in MOE_FAMILIES}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family_setup(request, moe_dirs):
    path = moe_dirs[request.param]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    return request.param, llm, _hf_model(path, "cpu")


def test_greedy_batch_matches_hf_generate(family_setup):
    test_hf_parity.test_greedy_batch_matches_hf_generate(family_setup)


def test_router_weights_are_not_degenerate(family_setup):
    """Ties between experts would let either engine pick either: the routers must spread tokens."""
    _, llm, _ = family_setup
    sparse = [layer.mlp for layer in llm.engine.model.layers if hasattr(layer.mlp, "route")]
    assert sparse
    x = torch.randn(64, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expert_ids, weights = sparse[-1].route(x)
    assert len(set(expert_ids.flatten().tolist())) == sparse[-1].moe.num_experts
    assert float(weights.std()) > 1e-3


def test_64_tokens_with_chunked_prefill_and_a_prefix_hit(moe_dirs):
    for family, path in moe_dirs.items():
        hf = _hf_model(path, "cpu")
        llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16,
                  enable_prefix_caching=True)
        params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64, logprobs=1)
        prompts = [PROMPTS[2], PROMPTS[7]]  # both longer than one 16-token chunk
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(first, again):
            assert b.num_cached_tokens > 0 and a.outputs[0].token_ids == b.outputs[0].token_ids
            ids = a.prompt_token_ids
            assert len(ids) > 16
            tokens = a.outputs[0].token_ids
            assert tokens == _hf_greedy(hf, ids, 64), family
            ref = torch.log_softmax(_hf_logits(hf, ids + tokens), dim=-1)
            for step, (token, entry) in enumerate(zip(tokens, a.outputs[0].logprobs)):
                assert abs(entry[token].logprob - float(ref[len(ids) - 1 + step][token])) < 1e-4, family
        assert_no_leak(llm.engine)


def test_every_expert_counts_in_the_weights(family_setup, moe_dirs):
    """The memory accounting (and so the KV budget left after weights) sees every expert's bytes:
    the model holds exactly the checkpoint's tensors."""
    from safetensors import safe_open

    from treeserve.runtime.memory import weights_bytes
    family, llm, _ = family_setup
    with safe_open(str(moe_dirs[family] / "model.safetensors"), framework="pt") as handle:
        on_disk = sum(handle.get_tensor(name).nbytes for name in handle.keys())
    assert weights_bytes(llm.engine) == on_disk
