"""Building blocks shared by every supported family: RMSNorm (and Gemma's), rotary embeddings, gated
MLP (SwiGLU, or GeGLU for Gemma)."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

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
                return self._fused(functools.partial(cpu_kernels.rms_norm, library), x, residual, self.weight)
            if (ops := fused_ops_for(x)) is not None:
                return self._fused(ops.rms_norm, x, residual, self.weight)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def _fused(self, rms_norm, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
        """One fused pass (`rms_norm(rows, weight, eps[, residual])`: the C kernel or the Triton op);
        with `residual`, x + residual is left in it."""
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return rms_norm(rows, weight, self.eps).view(x.shape)
        residual = residual.contiguous()
        out = rms_norm(rows, weight, self.eps, residual.view(-1, x.shape[-1]))
        return out.view(x.shape), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight w scales by (1 + w), and in float32 before the one
    rounding to the input's dtype (Llama's rounds, then scales). In float32 it is RMSNorm with
    1 + w, fused kernels included."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            return self.forward(residual), residual
        unit = 1.0 + self.weight.float()
        library = cpu_kernels.library_for(x)
        if x.dtype == torch.float32 and x.stride(-1) == 1 and not torch.is_grad_enabled():
            if library is not None:
                return self._fused(functools.partial(cpu_kernels.rms_norm, library), x, None, unit)
            if (ops := fused_ops_for(x)) is not None:
                return self._fused(ops.rms_norm, x, None, unit)
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * unit).to(dtype)


def make_norm(size: int, eps: float, gemma: bool) -> RMSNorm:
    return GemmaRMSNorm(size, eps) if gemma else RMSNorm(size, eps)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _longrope_frequencies(theta: float, factors: tuple[float, ...], head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if len(factors) != len(exponents):
        raise ValueError(f"longrope: {len(factors)} factors for {len(exponents)} frequencies (head size {head_dim})")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


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


class RotaryInputs(NamedTuple):
    """A rotation not yet applied, for an attention backend that applies it itself
    (`fuses_rotary`): each token's table row and the float32 tables."""
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half convention).

    LongRoPE (Phi-3) has two tables, short factors then long ones, the long one at rows
    `long_offset` on: `rope_positions` maps a token's position to its row. transformers picks the
    long factors for a whole forward pass once its sequence is past the original length, so a
    prompt longer than that uses them at every position, and a generated token from that position on."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        self.long_offset, self.long_from = 0, 0
        if rope.rope_type == "longrope":
            short = self._tables(_longrope_frequencies(rope.theta, rope.short_factor, head_dim), max_positions)
            long = self._tables(_longrope_frequencies(rope.theta, rope.long_factor, head_dim), max_positions)
            cos, sin = (torch.cat(pair) * rope.attention_factor for pair in zip(short, long))
            self.long_offset, self.long_from = max_positions, rope.original_max_position_embeddings
        else:
            cos, sin = self._tables(rope_inverse_frequencies(rope, head_dim), max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def _tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def rope_positions(self, num_prompt_tokens: int, positions):
        """The table rows of a sequence's tokens at `positions`, a tensor or one int (the positions
        themselves unless LongRoPE)."""
        if not self.long_offset:
            return positions
        if num_prompt_tokens > self.long_from:
            return positions + self.long_offset
        return positions + self.long_offset * (positions >= self.long_from)

    def inputs(self, positions: torch.Tensor) -> RotaryInputs:
        return RotaryInputs(positions, self.cos, self.sin)

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
    """SwiGLU MLP (GeGLU with `act="gelu_pytorch_tanh"`) with the gate and up projections fused into
    one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "applies_silu_mul", False):  # packed_linear.Bf16SiluMulLinear
            return self.down_proj(self.gate_up_proj(x))
        gate_up = self.gate_up_proj(x)
        if self.act != "silu":
            gate, up = gate_up.split(self.intermediate, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        library = cpu_kernels.library_for(gate_up)
        if library is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return self.down_proj(cpu_kernels.silu_mul(library, gate_up))
        if (ops := fused_ops_for(gate_up)) is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
