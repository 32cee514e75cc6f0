"""4-bit weights (GPTQ, AWQ, compressed-tensors W4A16) through PyTorch's own CPU kernel.

`aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` multiplies bfloat16 rows
by 4-bit weights packed once at load (`_convert_weight_to_int4pack_for_cpu`; its layout depends on the
CPU's vector width, so nothing here reads it back), dequantizing each as `(q - 8) * scale + zero` with
one (scale, zero) per output channel and group: a checkpoint's `(q - z) * s` is `zero = (8 - z) * s`.
Its limits: bfloat16 (or float16) rows (its float32 path is a plain loop, 30-70x slower: float32
models dequantize these weights at load instead, layers.py), groups of 32, 64, 128 or 256 input
features (one group per channel: the largest of those that divides the width, scales repeated),
output channels a multiple of 16. The scales and zeros are rounded to bfloat16, as vLLM's CPU kernels
round them to the activations' dtype.

Act order (GPTQ `desc_act`, compressed-tensors `actorder: group`): the input features are sorted by
group once at load and each call's activations gathered in that order (as exllama does), so the
groups are consecutive runs again.

Measured (2048 -> 8192, bfloat16, 2-core EPYC with avx512_bf16): 0.48 ms at 1 row against 1.49 for
the oneDNN-packed bfloat16 layer (3.1x), but 3.7 against 2.3 at 16 rows and 52 against 21 at 256:
the kernel widens every weight once per few rows. From `DEQUANTIZE_FROM_ROWS` rows (prefill) a
layer unpacks the kernel's layout back (`unpack_int4pack`, checked once per process; where the
check fails the kernel runs every row count) into a bfloat16 buffer and runs the GEMM. A
tiled kernel with bfloat16 dot products (as csrc's int8 one) and a C unpacker are the next steps.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from treeserve.model.packed_linear import scratch_weight
from treeserve.model.quantization.weights import IntWeight

KERNEL_GROUP_SIZES = (256, 128, 64, 32)
CHANNEL_MULTIPLE = 16
KERNEL = "_weight_int4pack_mm_for_cpu"
# Rows from which a layer dequantizes its weight into a per-shape buffer and runs the dense GEMM
# (`Int4Linear.dequantized`, ~25 ms for 2048x8192 in PyTorch ops): 8192x2048 in bfloat16 on a 2-core
# AVX512-BF16 EPYC, the kernel 25 ms at 128 rows against 40 dequantized, 50 against 45 at 256, 100
# against 65 at 512 (benchmarks/quantization.py --kernels)
DEQUANTIZE_FROM_ROWS = 256


def kernel_group_size(weight: IntWeight) -> int | None:
    """The group size the kernel runs this weight with, or None where it cannot."""
    out_features, in_features = weight.shape
    if weight.bits != 4 or out_features % CHANNEL_MULTIPLE or not hasattr(torch.ops.aten, KERNEL):
        return None
    if weight.g_idx is not None and not weight.groups_are_runs_when_sorted():
        return None
    if weight.group_size == in_features:  # one group per channel: any kernel group size that divides
        return next((g for g in KERNEL_GROUP_SIZES if in_features % g == 0), None)
    if weight.group_size in KERNEL_GROUP_SIZES and in_features % weight.group_size == 0:
        return weight.group_size
    return None


class Int4Linear(nn.Module):
    """A linear layer over 4-bit weights (see the module's note); bfloat16 or float16 activations."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        group_size = kernel_group_size(weight)
        if group_size is None:
            raise ValueError(f"Int4Linear: {weight.shape} in groups of {weight.group_size} is not the kernel's")
        self.out_features, self.in_features = weight.shape
        ordered = weight.in_act_order()
        if ordered is not None:
            weight, perm = ordered
        self.perm = None if ordered is None else nn.Parameter(perm, requires_grad=False)
        self.group_size = group_size
        repeat = weight.group_size // group_size
        scales = weight.scales.repeat_interleave(repeat, dim=1)
        zeros = (8.0 - weight.zeros.repeat_interleave(repeat, dim=1)) * scales
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values.to(torch.int32).contiguous(), 2)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous(),
                                             requires_grad=False)  # [groups, out, 2]
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.readable = layout_is_readable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        if rows.shape[0] >= DEQUANTIZE_FROM_ROWS and self.readable:
            out = torch.nn.functional.linear(rows, self.dequantized(rows.dtype))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.weight, self.group_size,
                                                             self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the kernel reads it, `(q - 8) * scale + zero`, in this thread's buffer for the
        shape (valid until the next call for it: use it at once); input features in act order."""
        buffer = scratch_weight((self.out_features, self.in_features), dtype, self.weight.device)
        unpack_int4pack(self.weight, self.out_features, self.in_features, out=buffer)
        scales = self.scales_and_zeros[..., 0].t().unsqueeze(-1).to(dtype)  # [out, groups, 1]
        zeros = self.scales_and_zeros[..., 1].t().unsqueeze(-1).to(dtype) - 8 * scales
        grouped = buffer.view(self.out_features, -1, self.group_size)
        return torch.addcmul(zeros, grouped, scales, out=grouped).view(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"act_order={self.perm is not None}, bias={self.bias is not None}")


@functools.cache
def layout_is_readable() -> bool:
    """Whether `unpack_int4pack` reads this CPU's layout back: checked once on whole blocks and a
    short one (the layout depends on the CPU's vector width, not on the values)."""
    values = torch.randint(0, 16, (144, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
    return torch.equal(unpack_int4pack(packed, 144, 64).int(), values)


def unpack_int4pack(packed: torch.Tensor, out_features: int, in_features: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """[out, in] values (uint8, or converted into `out`) from `_convert_weight_to_int4pack_for_cpu`'s
    layout (aten/src/ATen/native/cpu/int4mm_kernel.cpp): blocks of 64 output channels on AVX512 CPUs,
    32 elsewhere, each stored [in, block / 2] bytes; a whole block on AVX512 or AVX2 holds channel d
    in the low nibble of byte d and channel d + block / 2 in its high one, a short block (and any
    block without AVX) channels 2j and 2j + 1 in byte j. Callers check the result once against the
    values packed."""
    capability = torch.backends.cpu.get_cpu_capability()
    block = 64 if capability.startswith("AVX512") else 32
    halves = capability.startswith(("AVX512", "AVX2"))
    out = torch.empty(out_features, in_features, dtype=torch.uint8) if out is None else out
    flat, full = packed.reshape(-1), out_features // block * block
    if full:
        blocks = flat[:full * in_features // 2].view(full // block, in_features, block // 2)
        target = out[:full].view(full // block, block, in_features)
        if halves:  # each nibble plane converted and transposed in one copy
            target[:, :block // 2].copy_((blocks & 15).transpose(1, 2))
            target[:, block // 2:].copy_((blocks >> 4).transpose(1, 2))
        else:
            target[:, 0::2].copy_((blocks & 15).transpose(1, 2))
            target[:, 1::2].copy_((blocks >> 4).transpose(1, 2))
    if out_features > full:
        tail = flat[full * in_features // 2:].view(in_features, (out_features - full) // 2)
        out[full::2].copy_((tail & 15).t())
        out[full + 1::2].copy_((tail >> 4).t())
    return out
