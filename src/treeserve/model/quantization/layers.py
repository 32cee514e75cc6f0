"""The layer that runs a checkpoint's quantized projection: vLLM's `LinearMethod`, chosen once at load
by the weight's format and the activations' dtype.

| weight                                   | layer                                                     |
|------------------------------------------|-----------------------------------------------------------|
| 4-bit, bfloat16 activations, AVX512-BF16 | `CsrcInt4Linear` (treeserve's int4 kernel; act order too) |
| 4-bit, bfloat16 activations, elsewhere   | `Int4Linear` (PyTorch's int4 kernel; act order permuted)  |
| 8-bit symmetric, one scale per channel   | `Int8Linear` (treeserve's int8 kernel, weight-only)       |
| 8-bit with int8 activations (W8A8)       | `Int8W8A8Linear` (`torch._int_mm`)                        |
| FP8                                      | dequantized at load (`Fp8InputLinear` rounds the inputs)  |
| anything else                            | dequantized at load to the activations' dtype             |

"Anything else": 4-bit in float32 (the int4 kernel's float32 path is a plain loop) or where the
kernel's shape limits fail (int4.py), 8-bit with groups or zero points (GPTQ 8-bit with a group
size, compressed-tensors W8A16's default groups of 128), a fused projection whose parts disagree.
For group-wise 8-bit the bfloat16 layer it becomes (oneDNN-packed where the CPU has bf16 units)
is the fastest correct one found: the int8 kernel has one scale per channel, and calling it once
per group of 128 inputs (weights stored [groups, out, 128], float32 sums) measured 1.08 ms against
0.78 for the packed bfloat16 layer at 1 row and 4.9 against 1.7 at 16 (8192 x 2048, 2-core EPYC
with avx512_bf16); splitting each byte into two 4-bit halves for the int4 kernel (`16 * hi + lo`)
costs two int4 products (2 x 0.48 ms against 1.49 at one row by the int4 kernel's own times, 2 x 3.7
against 2.3 at 16), and its zeros, (136 - z) * s rounded to bfloat16, err by a quarter step.
The dequantized layers are plain `nn.Linear`s: `pack_linears` packs them like any other.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from treeserve.model.parallel import TensorParallel
from treeserve.model.quantization.activations import Fp8InputLinear, Int8W8A8Linear
from treeserve.model.quantization.int4 import Int4Linear, kernel_group_size
from treeserve.model.quantization.int4_csrc import CsrcInt4Linear, csrc_int4_runs
from treeserve.model.quantization.int8 import Int8Linear
from treeserve.model.quantization.weights import FloatWeight, IntWeight

logger = logging.getLogger(__name__)


def quantized_layer(weight: IntWeight | FloatWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                    split_inputs: TensorParallel | None = None) -> nn.Module:
    """The layer for one (fused) projection's weight; `bias` as the model holds it (or None).
    `split_inputs`: the ranks that each hold a share of this projection's inputs (a row-parallel
    one's), over which run-time input scales are taken, so that they are tensor_parallel_size=1's."""
    if isinstance(weight, IntWeight):
        if weight.input_quant == "int8_token":
            return Int8W8A8Linear(weight, bias, dtype, split_inputs)
        if csrc_int4_runs(weight, dtype):
            return CsrcInt4Linear(weight, bias, dtype)
        if weight.bits == 4 and dtype in (torch.bfloat16, torch.float16) and kernel_group_size(weight) is not None:
            return Int4Linear(weight, bias, dtype)
        if weight.bits == 8 and weight.scales.shape[1] == 1 and weight.symmetric():
            signed = (weight.values.to(torch.int16) - 128).to(torch.int8)
            return Int8Linear(quantized=signed, scales=weight.scales[:, 0], bias=bias, dtype=dtype, consume=True)
    linear = dequantized_linear(weight, bias, dtype)
    if isinstance(weight, FloatWeight) and weight.input_quant is not None:
        return Fp8InputLinear(linear, weight.input_scale, split_inputs)
    return linear


def dequantized_linear(weight: IntWeight | FloatWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    out_features, in_features = weight.shape
    with torch.device("meta"):
        linear = nn.Linear(in_features, out_features, bias=bias is not None)
    linear.weight = nn.Parameter(weight.dequantize(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return linear
