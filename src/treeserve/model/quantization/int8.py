"""Weight-only int8 with one scale per output channel: `--quantization int8` made at load from a
float or bfloat16 checkpoint (vLLM's and TGI's on-the-fly int8), and the 8-bit checkpoints
(GPTQ 8-bit, compressed-tensors W8A16) whose weights are symmetric with one group per channel.

On the fly, each output channel of every decoder-layer projection (attention qkv and output, the
MLP's gate/up and down) is scaled symmetrically to [-127, 127], `w ~= scale * q`. A step of few rows
reads half the bytes of bfloat16 weights: treeserve's C kernel (`ts_int8_linear`, AVX512: int8
widened in registers, tiles of 4 rows x 4 channels, bfloat16 dot products where the CPU has them,
float32 FMAs otherwise; PyTorch's `aten._weight_int8pack_mm` where it cannot run) multiplies the
rows by the int8 weights and their scales. A step with many rows is compute-bound instead: it
dequantizes the weight once into a per-shape buffer and runs the activation dtype's GEMM. The
embeddings, the LM head, a reward head, MoE routers and experts stay as stored. With tensor
parallelism each rank quantizes its own shards, a row-parallel projection's (o_proj, down_proj)
channels by the largest weight of the whole row (`channel_amax`, read by the loader), so that the
ranks' weights are one rank's.

Measured (benchmarks/quantization.py, Llama-3.2-1B shape, bfloat16, 2-core AMD EPYC with
avx512_bf16): decode 1.30-1.35x bfloat16's at batch 1, 0.64-0.73x at 16, 0.98x at 64 (the dequantized
GEMM); prefill 1.00x; peak RSS 0.69x (0.78x once the tied LM head got its packed copy). At batch
16 the kernel's arithmetic is the bound (widening every weight once per 4 rows): VNNI int8
products (W8A8) or AMX tiles are the next step.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.model import cpu_kernels
from treeserve.model.packed_linear import scratch_weight

QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Rows from which a layer dequantizes its weight and runs the dense GEMM: 2048x8192 in bfloat16 on
# a 2-core AVX512-BF16 EPYC (benchmarks/quantization.py --kernels), the C kernel (bf16 dot products)
# 4.2 ms at 32 rows against 5.0 dequantized, 8.9 against 7.4 at 64
DEQUANTIZE_FROM_ROWS = 48
# PyTorch's int8 kernel crashed (segfault, torch 2.13 on CPU) on 40 input features; it runs only on
# widths that are a multiple of this (every real model's), other layers take the dequantized GEMM
ATEN_INT8_MULTIPLE = 64


class Int8Linear(nn.Module):
    """A linear layer over int8 weights with one scale per output channel (see the module's note)."""

    def __init__(self, linear: nn.Linear | None = None, *, quantized: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 channel_amax: torch.Tensor | None = None):
        """From a float `linear` (quantized here; `channel_amax`: each output channel's largest
        absolute weight where the linear holds a share of its inputs, a row-parallel rank's), or
        from a checkpoint's int8 weights [out, in] and their float32 scales [out]."""
        super().__init__()
        if linear is not None:
            weight = linear.weight.detach().float()
            amax = weight.abs().amax(dim=1) if channel_amax is None else channel_amax.float()
            scales = amax.clamp(min=1e-12) / 127.0
            quantized = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
            bias = linear.bias
        self.out_features, self.in_features = quantized.shape
        self.weight = nn.Parameter(quantized.contiguous(), requires_grad=False)
        self.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """scale x int8 in `dtype`, in this thread's buffer for the shape (valid until the next call
        for that shape: use it at once)."""
        buffer = scratch_weight(self.weight.shape, dtype, self.weight.device)
        library = cpu_kernels.library_for(buffer)
        if library is not None:
            return cpu_kernels.int8_dequantize(library, self.weight, self.scales, buffer)
        return buffer.copy_(self.weight).mul_(self.scales.to(dtype)[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = None
        if rows.shape[0] < DEQUANTIZE_FROM_ROWS:
            library = cpu_kernels.library_for(rows)
            if library is not None and rows.stride(-1) == 1:
                out = cpu_kernels.int8_linear(library, rows, self.weight, self.scales)
            if out is None and self.in_features % ATEN_INT8_MULTIPLE == 0:  # no kernel of ours for it: PyTorch's
                out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales.to(rows.dtype))
        if out is None:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(model: nn.Module, method: str | None, channel_amax: dict[str, torch.Tensor] | None = None) -> int:
    """With `method` "int8" (made on the fly), replaces the decoder layers' projections by
    `Int8Linear`s; returns how many. `channel_amax`: by module name (layers.0.self_attn.o_proj),
    the channels' largest weights of projections whose inputs are split over ranks."""
    if method != "int8":
        return 0
    count = 0
    # the parents only: a list holding the float linears too would keep every one alive until the end
    parents = [(name, module) for name, module in model.named_modules()
               if name.startswith("layers.") and type(module) is not nn.Linear]
    for parent_name, parent in parents:
        for name, child in list(parent.named_children()):
            if name in QUANTIZED_PROJECTIONS and type(child) is nn.Linear:
                amax = (channel_amax or {}).get(f"{parent_name}.{name}")
                setattr(parent, name, Int8Linear(child, channel_amax=amax))
                count += 1
    return count
