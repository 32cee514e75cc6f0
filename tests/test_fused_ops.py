"""The fused per-layer Triton operations (RMSNorm + residual, rotary, SiLU * up) against the PyTorch
code they replace on CUDA (the layers' unfused path, which follows HF transformers' rounding).
Without CUDA they run under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from treeserve.model.hf_config import RopeConfig  # noqa: E402
from treeserve.model.kernels import fused_ops  # noqa: E402
from treeserve.model.layers import RMSNorm, RotaryEmbedding, _rotate_half  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 only on a device: Triton's interpreter has no bfloat16
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# float32 agrees to rounding; 16-bit types may differ by one unit where an intermediate rounds
# differently (a unit at 1: 2^-10 in float16, 2^-7 in bfloat16)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def reference_rms_norm(norm: RMSNorm, x, residual):
    if residual is None:
        return norm._norm(x), None
    total = x + residual
    return norm._norm(total), total


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 80, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_unfused_norm(dtype, size, with_residual):
    norm = RMSNorm(size, 1e-6).to(dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(size, dtype=dtype, seed=3))
    x = randn(7, size, dtype=dtype, seed=1)
    residual = randn(7, size, dtype=dtype, seed=2) if with_residual else None
    expected, expected_sum = reference_rms_norm(norm, x, residual)
    out = fused_ops.rms_norm(x, norm.weight.detach(), norm.eps, residual)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    if with_residual:  # the sum is left in the residual, for the next layer
        torch.testing.assert_close(residual, expected_sum, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (3, 1, 80), (8, 8, 32)])
def test_rotary_in_place_matches_rotate_half(dtype, heads, kv_heads, head_dim):
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 256).to(DEVICE)
    tokens = 9
    # q and k as views into one projection output, as the attention layer splits them
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 100, 255, 3, 3, 64], device=DEVICE)
    cos = rotary.cos[positions].to(dtype)[:, None, :]
    sin = rotary.sin[positions].to(dtype)[:, None, :]
    expected_q = q * cos + _rotate_half(q) * sin
    expected_k = k * cos + _rotate_half(k) * sin
    untouched = qkv[:, (heads + kv_heads) * head_dim:].clone()
    fused_ops.rotary_(q, k, positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], untouched)  # v is not rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [48, 1500])
def test_silu_mul_matches_the_unfused_mlp_activation(dtype, size):
    gate_up = randn(5, 2 * size, dtype=dtype, seed=7) * 4
    gate, up = gate_up.split(size, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), expected, **TOLERANCE[dtype])
