"""4-bit weights (GPTQ, AWQ, compressed-tensors W4A16) through treeserve's own kernel,
csrc/int4_linear.c, where it runs: bfloat16 activations on a CPU with AVX512-BF16, input features a
multiple of 32, groups of a multiple of 32 inputs (one group per channel included); elsewhere
PyTorch's kernel (int4.py) or the dequantized weight (layers.py).

The kernel reads the weights in its own layout (`cpu_kernels.int4_pack`, made once at load), the
scales and zero points as the checkpoint gives them (float32, any zero point), and turns each
nibble into bfloat16 by its bits (no table, no shuffle), so that a few rows read a quarter of
bfloat16's bytes and widen each weight once per 4 rows. Act order (GPTQ `desc_act`) as in int4.py:
input features sorted by group at load, each call's activations gathered in that order.

Measured (`benchmarks/int4_linear.py`, 2-core EPYC with avx512_bf16, weights from memory, groups of
128): 2048 -> 8192 at 1 row 0.50 ms against 0.45 for PyTorch's kernel and 1.20 for the oneDNN
bfloat16 layer; at 16 rows 2.33 against 3.20 and 1.68; at 64, 8.7 against 12.9 and 5.5. From
`DEQUANTIZE_FROM_ROWS` rows a layer dequantizes its weight once per call (C, into a per-shape
buffer) and runs the bfloat16 GEMM instead.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.model import cpu_kernels
from treeserve.model.packed_linear import scratch_weight
from treeserve.model.quantization.weights import IntWeight

# Rows from which the dequantized weight and the bfloat16 GEMM beat the kernel: 8192x2048 and
# 2048x8192 on a 2-core AVX512-BF16 EPYC: 32 rows 4.3-4.5 ms against 4.6-5.0, 48 rows 6.4-6.6 against
# 5.8-6.2 (the dequantization 1.6-2.2 ms)
DEQUANTIZE_FROM_ROWS = 40


def csrc_int4_runs(weight: IntWeight, dtype: torch.dtype) -> bool:
    """Whether csrc/int4_linear.c runs this weight with these activations here."""
    out_features, in_features = weight.shape
    if weight.bits != 4 or dtype != torch.bfloat16 or weight.input_quant is not None:
        return False
    if in_features % 32 or weight.group_size % 32 or in_features % weight.group_size:
        return False
    if not weight.groups_are_runs_when_sorted():
        return False
    library = cpu_kernels.load()
    return library is not None and library.ts_int4_supported() == 1


class CsrcInt4Linear(nn.Module):
    """A linear layer over 4-bit weights in csrc/int4_linear.c's layout (see the module's note)."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        if not csrc_int4_runs(weight, dtype):
            raise ValueError(f"CsrcInt4Linear: {weight.shape} in groups of {weight.group_size} in {dtype} is not "
                             "the kernel's")
        self.out_features, self.in_features = weight.shape
        ordered = weight.in_act_order()
        if ordered is not None:
            weight, perm = ordered
        self.perm = None if ordered is None else nn.Parameter(perm, requires_grad=False)
        self.group_size = weight.group_size
        self.weight = nn.Parameter(cpu_kernels.int4_pack(weight.values), requires_grad=False)
        self.scales = nn.Parameter(weight.scales.float().contiguous(), requires_grad=False)
        self.zeros = nn.Parameter(weight.zeros.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        library = cpu_kernels.library_for(rows)
        out = None
        if library is not None and rows.shape[0] < DEQUANTIZE_FROM_ROWS:
            rows = rows if rows.stride(-1) == 1 else rows.contiguous()
            out = cpu_kernels.int4_linear(library, rows, self.weight, self.scales, self.zeros, self.group_size)
        if out is None:
            out = F.linear(rows, self.dequantized(rows.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """scale x (q - zero) in bfloat16, input features in act order, in this thread's buffer for the
        shape (valid until the next call for it: use it at once)."""
        buffer = scratch_weight((self.out_features, self.in_features), torch.bfloat16, self.weight.device)
        cpu_kernels.int4_dequantize(cpu_kernels.load(), self.weight, self.scales, self.zeros, self.group_size, buffer)
        return buffer if dtype == torch.bfloat16 else buffer.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"act_order={self.perm is not None}, bias={self.bias is not None}")
