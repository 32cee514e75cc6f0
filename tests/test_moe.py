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


def test_packed_experts_in_bfloat16_match_the_unpacked_ones(moe_dirs, monkeypatch):
    """bfloat16 on a CPU with bfloat16 units: every expert's weights in oneDNN's layout
    (`StackedExperts.pack`) give the tokens and (to bf16 rounding) the logits of the stacked
    weights, and the memory accounting counts the packed bytes."""
    import treeserve.model.loader as loader
    from treeserve.model.packed_linear import can_pack
    from treeserve.runtime.memory import weights_bytes
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("hardware: no bfloat16 units here (or no oneDNN): the experts stay stacked")
    prompt = list(range(3, 40))

    def run():
        from treeserve import SamplingParams
        llm = LLM(str(moe_dirs["mixtral"]), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=8 << 20)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16, logprobs=1),
                           use_tqdm=False)[0].outputs[0]
        return llm, out.token_ids, [next(iter(p.values())).logprob for p in out.logprobs]
    packed_llm, packed_tokens, packed_logprobs = run()
    assert any(layer.mlp.experts.packed for layer in packed_llm.engine.model.layers if hasattr(layer.mlp, "experts"))
    monkeypatch.setattr(loader, "pack_experts", lambda *args: 0)
    stacked_llm, tokens, logprobs = run()
    assert packed_tokens == tokens
    assert packed_logprobs == pytest.approx(logprobs, abs=0.05)
    assert weights_bytes(packed_llm.engine) == weights_bytes(stacked_llm.engine)
