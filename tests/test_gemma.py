"""Gemma 1, 2 and 3 (text) against HF transformers on random tiny models: GeGLU, (1 + w) norms with
random w, the scaled embedding, Gemma 2's sandwich norms, query scale and soft caps (small enough
to bite: 4 on scores, 6 on logits) with every other layer under a 16-token window, Gemma 3's q/k
norms and its local RoPE on the sliding layer (linear-scaled global RoPE on the other). Prompt
logits, a greedy batch with logprobs, and 64 greedy tokens with chunked prefill, a prefix-cache
hit and prompts longer than the window."""
import pytest
import torch

from conftest import assert_no_leak
import test_hf_parity
from test_hf_parity import PROMPTS, _hf_logits, _hf_model, _relative_error
from test_hf_parity import test_prompt_logits_match_hf  # noqa: F401 (run here on these families)
from treeserve import LLM, SamplingParams
from treeserve.model.hf_config import parse_model_config
from treeserve.testing.tiny_models import GEMMA_FAMILIES, GEMMA_WINDOW, make_tiny_model


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-models")
    return {family: make_tiny_model(family, root / family, seed=3) for family in GEMMA_FAMILIES}


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def family_setup(request, gemma_dirs):
    path = gemma_dirs[request.param]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    return request.param, llm, _hf_model(path, "cpu")


def test_greedy_batch_matches_hf_generate(family_setup):
    test_hf_parity.test_greedy_batch_matches_hf_generate(family_setup)


def test_the_tiny_models_exercise_what_gemma_adds(family_setup):
    """The switches are on (a parity test with them off would prove nothing about them)."""
    family, llm, hf = family_setup
    config = llm.engine.model_config
    assert config.gemma_norms and config.hidden_act == "gelu_pytorch_tanh" and config.embed_scale == 8.0
    norms = [p for name, p in hf.named_parameters() if name.endswith("norm.weight")]
    assert all(float(p.detach().abs().max()) > 0.1 for p in norms)  # w random, not HF's initial zeros
    if family == "gemma2":
        assert config.sliding_windows == (GEMMA_WINDOW, None)
        assert config.attn_softcap == 4.0 and config.final_softcap == 6.0 and config.attn_scale == 24 ** -0.5
    if family == "gemma3":
        assert config.sliding_windows == (GEMMA_WINDOW, None) and config.qk_norm
        assert config.local_rope.theta == 10000.0 and config.rope.rope_type == "linear"


def test_64_tokens_with_chunked_prefill_and_a_prefix_hit(gemma_dirs):
    for family, path in gemma_dirs.items():
        test_hf_parity.check_64_tokens_with_chunked_prefill_and_a_prefix_hit(path, family, GEMMA_WINDOW)


def test_published_config_layouts_are_read_as_transformers_reads_them():
    """Configs as published (before transformers 5 wrote `layer_types` and per-type RoPE): Gemma 2
    alternates sliding and global layers, Gemma 3 has one global layer in six and its local RoPE
    base under `rope_local_base_freq`; Gemma's legacy "gelu" is the tanh approximation."""
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                head_dim=16, rms_norm_eps=1e-6)
    gemma2 = parse_model_config(dict(base, architectures=["Gemma2ForCausalLM"], sliding_window=4096,
                                     query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                     final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"))
    assert gemma2.sliding_windows == (4096, None) * 3 and gemma2.attn_scale == 1 / 16
    gemma3 = parse_model_config(dict(base, architectures=["Gemma3ForCausalLM"], sliding_window=512,
                                     sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                     rope_scaling={"rope_type": "linear", "factor": 8.0},
                                     final_logit_softcapping=None))
    assert gemma3.sliding_windows == (512,) * 5 + (None,)
    assert (gemma3.rope.theta, gemma3.rope.factor, gemma3.local_rope.theta) == (1000000.0, 8.0, 10000.0)
    assert gemma3.final_softcap is None and gemma3.qk_norm
    gemma = parse_model_config(dict(base, architectures=["GemmaForCausalLM"], hidden_act="gelu"))
    assert gemma.hidden_act == "gelu_pytorch_tanh" and not gemma.sandwich_norms
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        parse_model_config(dict(base, architectures=["LlamaForCausalLM"], hidden_act="relu"))


def test_gemma2_logits_through_the_triton_kernels(gemma_dirs):
    """Soft-capped scores and the window in the Triton kernels (interpreted without CUDA)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = gemma_dirs["gemma2"]
    llm = LLM(str(path), dtype="float32", device=device, kv_cache_memory_bytes=8 << 20, attention_backend="triton")
    assert llm.engine.model.backend.name == "triton"
    hf, engine = _hf_model(path, device), llm.engine
    prompts = [llm.get_tokenizer().encode(PROMPTS[i]) for i in (2, 7)]  # both past the window
    for i, ids in enumerate(prompts):
        engine.add_request(f"logits-{i}", ids, SamplingParams(), logits_positions=list(range(len(ids))))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    for i, ids in enumerate(prompts):
        ours = torch.stack([outputs[f"logits-{i}"].prompt_logits[p].cpu() for p in range(len(ids))])
        assert _relative_error(ours, _hf_logits(hf, ids)) < 1e-4
    assert_no_leak(engine)
