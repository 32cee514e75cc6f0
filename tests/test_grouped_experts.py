"""The Triton grouped-expert products (the CUDA path of model/moe.py) against the PyTorch loop over
experts they replace: pairs sorted and padded per expert, an expert nobody chose, a single token,
float32 and float16, top-1 and top-2, Mixtral's float32 routing weights. Interpreted on CPU
without CUDA (conftest sets TRITON_INTERPRET=1); on CUDA, a Mixtral against HF too."""
import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from treeserve.model.kernels import grouped_experts  # noqa: E402
from treeserve.model.moe import StackedExperts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _silu_mul(h):
    half = h.shape[-1] // 2
    return F.silu(h[:, :half]) * h[:, half:]


def test_align_pairs_groups_each_expert_in_whole_blocks():
    expert_ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    sorted_ids, block_experts = grouped_experts.align_pairs(expert_ids, num_experts=5, block_m=4)
    pad = 6
    assert block_experts.tolist() == [0, 2, 3]  # experts 1 and 4: no block
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]


# bfloat16 only on a device (Triton's interpreter has no bfloat16); its tolerance is ~2.5 units at 1
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)]
                         + ([(torch.bfloat16, 2e-2)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (37, 2), (20, 1)])
def test_grouped_products_match_the_loop_over_experts(dtype, tol, tokens, top_k):
    generator = torch.Generator().manual_seed(tokens)
    experts = StackedExperts(num_experts=6, hidden=48, intermediate=40)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 80, 48, generator=generator) * 0.2)
        experts.down_proj.copy_(torch.randn(6, 48, 40, generator=generator) * 0.2)
    x = torch.randn(tokens, 48, generator=generator)
    scores = torch.randn(tokens, 6, generator=generator)
    scores[:, 5] = -1e9  # expert 5: chosen by no token
    weights, expert_ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    expected = experts.to(dtype)(x.to(dtype), expert_ids, weights).float()
    ours = grouped_experts.experts_forward(x.to(dtype).to(DEVICE), experts.gate_up_proj.detach().to(DEVICE),
                                           experts.down_proj.detach().to(DEVICE), expert_ids.to(DEVICE),
                                           weights.to(DEVICE), _silu_mul)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="hardware: no CUDA device (the engine takes the grouped kernel on CUDA only)")
def test_mixtral_on_cuda_matches_hf(tmp_path):
    from test_hf_parity import PROMPTS, _hf_logits, _hf_model, _relative_error
    from treeserve import LLM, SamplingParams
    from treeserve.testing.tiny_models import make_tiny_model
    path = make_tiny_model("mixtral", tmp_path / "mixtral", seed=2)
    llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory_bytes=8 << 20)
    hf = _hf_model(path, "cuda")
    ids = llm.get_tokenizer().encode(PROMPTS[7])
    llm.engine.add_request("r", ids, SamplingParams(), logits_positions=list(range(len(ids))))
    out = {}
    while llm.engine.has_unfinished_requests():
        out.update({o.request_id: o for o in llm.engine.step() if o.finished})
    ours = torch.stack([out["r"].prompt_logits[p].cpu() for p in range(len(ids))])
    assert _relative_error(ours, _hf_logits(hf, ids)) < 1e-4
