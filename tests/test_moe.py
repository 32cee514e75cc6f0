"""Mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert and a dense layer,
Qwen3-MoE) against HF transformers on random tiny models: test_hf_parity's logits and greedy
tests, and 64 greedy tokens with chunked prefill and a prefix-cache hit."""
import pytest
import torch

import test_hf_parity
from test_hf_parity import _hf_model, test_prompt_logits_match_hf  # noqa: F401 (run here on these families)
from treeserve import LLM
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
        test_hf_parity.check_64_tokens_with_chunked_prefill_and_a_prefix_hit(path, family)


def test_every_expert_counts_in_the_weights(family_setup, moe_dirs):
    """The memory accounting (and so the KV budget left after weights) sees every expert's bytes:
    the model holds exactly the checkpoint's tensors."""
    from safetensors import safe_open

    from treeserve.runtime.memory import weights_bytes
    family, llm, _ = family_setup
    with safe_open(str(moe_dirs[family] / "model.safetensors"), framework="pt") as handle:
        on_disk = sum(handle.get_tensor(name).nbytes for name in handle.keys())
    assert weights_bytes(llm.engine) == on_disk
