"""The small per-layer operations fused into one Triton launch each, for the GPU path: RMSNorm with
the residual add, rotary embedding in place on q and k, and SiLU(gate) * up.

Unfused, PyTorch runs each as several elementwise and reduction kernels (a decode step of a
16-layer model launched ~100 of them per layer); one launch each keeps a CUDA-graph replay short.
Each rounds where HF transformers' PyTorch code rounds (the sum to the model's dtype before the
norm, the normalised row before the weight, each product of the rotation, SiLU before the
product), so bfloat16 results match the reference's, not a more precise function of them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                     SIZE: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < SIZE
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / SIZE + eps)
    normed = (xf * inverse).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x's rows ([N, D], last dimension contiguous); given `residual` ([N, D]), normalises
    x + residual and leaves that sum in `residual`."""
    size = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        SIZE=size, BLOCK=triton.next_power_of_2(size), HAS_RESIDUAL=residual is not None,
        num_warps=4 if size <= 4096 else 8,
    )
    return out


@triton.jit
def _rotate_heads(src_ptr, stride_src, dst_ptr, stride_dst, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """Rotates the heads at `src_ptr` into `dst_ptr` (the same place: in place)."""
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HALF_P)[None, :]
    ok = (heads < NUM_HEADS) & (dims < HALF)
    first_ptrs = src_ptr + heads * stride_src + dims
    first = tl.load(first_ptrs, mask=ok, other=0.0)
    second = tl.load(first_ptrs + HALF, mask=ok, other=0.0)
    dtype = first.dtype
    f, s = first.to(tl.float32), second.to(tl.float32)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin, each product rounded as PyTorch's would be
    new_first = (f * cos).to(dtype).to(tl.float32) + (-s * sin).to(dtype).to(tl.float32)
    new_second = (s * cos).to(dtype).to(tl.float32) + (f * sin).to(dtype).to(tl.float32)
    out_ptrs = dst_ptr + heads * stride_dst + dims
    tl.store(out_ptrs, new_first.to(dtype), mask=ok)
    tl.store(out_ptrs + HALF, new_second.to(dtype), mask=ok)


@triton.jit
def _angles(positions_ptr, token, cos_ptr, sin_ptr, stride_table, dtype: tl.constexpr, HALF: tl.constexpr,
            HALF_P: tl.constexpr):
    """The token's cos and sin ([1, HALF_P] float32), rounded to the model's dtype first."""
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P)[None, :]
    # the tables hold [freqs, freqs]: the first half of a row is every angle once
    cos = tl.load(cos_ptr + position * stride_table + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + dims, mask=dims < HALF, other=0.0)
    # the reference casts the tables to the model's dtype
    return cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_table, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   Q_HEADS_P: tl.constexpr, K_HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _angles(positions_ptr, token, cos_ptr, sin_ptr, stride_table, q_ptr.dtype.element_ty, HALF, HALF_P)
    q = q_ptr + token * stride_qt
    k = k_ptr + token * stride_kt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, NUM_Q_HEADS, HALF, Q_HEADS_P, HALF_P)
    _rotate_heads(k, stride_kh, k, stride_kh, cos, sin, NUM_K_HEADS, HALF, K_HEADS_P, HALF_P)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates q ([T, Hq, D]) and k ([T, Hkv, D]) in place by each token's position (rotate-half);
    cos/sin: [max_positions, D] float32 tables."""
    half = q.shape[-1] // 2
    _rotary_kernel[(q.shape[0],)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half, Q_HEADS_P=triton.next_power_of_2(q.shape[1]),
        K_HEADS_P=triton.next_power_of_2(k.shape[1]), HALF_P=triton.next_power_of_2(half),
    )


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < SIZE
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + SIZE + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate then up, last dimension contiguous) -> SiLU(gate) * up, [N, I]."""
    size = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), SIZE=size, BLOCK=block)
    return out
