"""Building blocks shared by every supported family: RMSNorm, rotary embeddings, gated MLP."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.model import cpu_kernels
from treeserve.model.kernels import fused_ops_for
from treeserve.model.hf_config import RopeConfig


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension. Given `residual`, normalises x + residual and returns
    (normed, x + residual): the residual add fused in, as vLLM's layers do."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        library = cpu_kernels.library_for(x)
        weight_grad = torch.is_grad_enabled() and self.weight.requires_grad  # the kernel has no backward
        if not weight_grad and self.weight.dtype == x.dtype and x.stride(-1) == 1:
            if library is not None:
                return self._fused(library, x, residual)
            if (ops := fused_ops_for(x)) is not None:
                return self._fused_triton(ops, x, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def _fused_triton(self, ops, x: torch.Tensor, residual: torch.Tensor | None):
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return ops.rms_norm(rows, self.weight, self.eps).view(x.shape)
        residual = residual.contiguous()
        out = ops.rms_norm(rows, self.weight, self.eps, residual.view(-1, x.shape[-1]))
        return out.view(x.shape), residual

    def _fused(self, library, x: torch.Tensor, residual: torch.Tensor | None):
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return cpu_kernels.rms_norm(library, rows, self.weight, self.eps).view(x.shape)
        residual = residual.contiguous()
        out = cpu_kernels.rms_norm(library, rows, self.weight, self.eps, residual.view(-1, x.shape[-1]))
        return out.view(x.shape), residual


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half convention)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D]; returns both rotated (on CPU, in place where it can)."""
        library = cpu_kernels.library_for(q)
        if library is not None and cpu_kernels.heads_contiguous(q) and cpu_kernels.heads_contiguous(k):
            cpu_kernels.rotary_(library, q, k, positions, self.cos, self.sin)
            return q, k
        if (ops := fused_ops_for(q)) is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            ops.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        library = cpu_kernels.library_for(gate_up)
        if library is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return self.down_proj(cpu_kernels.silu_mul(library, gate_up))
        if (ops := fused_ops_for(gate_up)) is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
