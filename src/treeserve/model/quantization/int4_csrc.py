"""4-bit weights (GPTQ, AWQ, compressed-tensors W4A16) through treeserve's own kernels,
csrc/int4_linear.c, where they run: bfloat16 activations on a CPU with AVX512-BF16, input features a
multiple of 32, groups of a multiple of 32 inputs (one group per channel included); elsewhere
PyTorch's kernel (int4.py) or the dequantized weight (layers.py). Act order (GPTQ `desc_act`) as in
int4.py: input features sorted by group at load, each call's activations gathered in that order.

Two layouts, both made once at load, scales and zero points as the checkpoint gives them (float32,
any zero point):
- with AVX512-VNNI too, and groups the packed kernel's spans fit (`ts_int4_packed16_span`: a group
  of up to 256 inputs, a multiple of 256, or the whole row), the packed one (`linear_kernels.int4_pack16`:
  blocks of 64 channels read in order, two nibbles a byte for vpdpwssd's pairs); the rows enter as
  16-bit integers under a power of two per span (csrc/rows16.h: elements within 2^7 of a span's
  largest exact, the others within 2^-15 of it) and the zero points' share is taken from the
  rows' span sums; any number of rows;
- otherwise row-major runs (`linear_kernels.int4_pack`), each nibble turned into bfloat16 by its bits
  (no table, no shuffle) for vdpbf16ps; from `DEQUANTIZE_FROM_ROWS` rows a layer dequantizes its
  weight once per call (C, into a per-shape buffer) and runs the bfloat16 GEMM instead.

Measured (`python benchmarks/quantized_step.py`: the Llama-3.2-1B shape's 112 projections of one
step, groups of 128, 2-core EPYC with avx512_bf16 and avx512_vnni, two runs): packed 18.8-19.7 ms at
1 row against 30-31 row-major and 81-96 for oneDNN's bfloat16; 95-98 against 139-141 and 106-112 at
16 rows; 338 against 434 and 315 at 64.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.model import cpu_kernels, linear_kernels
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

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool | None = None):
        """`pack`: the packed layout (default: where its kernel runs this weight, see the module's note)."""
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
        packable = cpu_kernels.load().ts_int4_packed16_span(self.in_features, self.group_size) > 0
        if pack and not packable:
            raise ValueError(f"CsrcInt4Linear: the packed kernel does not run groups of {self.group_size} of "
                             f"{self.in_features} inputs here")
        self.packed = packable if pack is None else pack
        if self.packed:  # the blocked layout, scales and zero points [blocks, groups, 64]
            self.weight = nn.Parameter(linear_kernels.int4_pack16(weight.values.to(torch.uint8)), requires_grad=False)
            self.scales = nn.Parameter(linear_kernels.int4_pack16_groups(weight.scales.float()), requires_grad=False)
            self.zeros = nn.Parameter(linear_kernels.int4_pack16_groups(weight.zeros.float()), requires_grad=False)
        else:
            self.weight = nn.Parameter(linear_kernels.int4_pack(weight.values), requires_grad=False)
            self.scales = nn.Parameter(weight.scales.float().contiguous(), requires_grad=False)
            self.zeros = nn.Parameter(weight.zeros.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        out = None
        if self.packed:
            out = self._packed_product(rows)
        elif (library := cpu_kernels.library_for(rows)) is not None and rows.shape[0] < DEQUANTIZE_FROM_ROWS:
            out = linear_kernels.int4_linear(library, rows, self.weight, self.scales, self.zeros, self.group_size)
        if out is None:
            out = F.linear(rows, self.dequantized(rows.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _packed_product(self, rows: torch.Tensor) -> torch.Tensor:
        """Any number of rows: at oneDNN's bfloat16 rate from a few dozen on."""
        if rows.dtype != torch.bfloat16 or rows.device.type != "cpu":
            raise RuntimeError(f"CsrcInt4Linear: its weights are packed for bfloat16 rows on CPU, not {rows.dtype} "
                               f"on {rows.device}")
        return linear_kernels.int4_linear_packed16(cpu_kernels.load(), rows, self.weight, self.scales, self.zeros,
                                                self.out_features, self.group_size)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """scale x (q - zero) in bfloat16, input features in act order, in this thread's buffer for the
        shape (valid until the next call for it: use it at once)."""
        buffer = scratch_weight((self.out_features, self.in_features), torch.bfloat16, self.weight.device)
        if self.packed:
            q = linear_kernels.int4_unpack16(self.weight, self.out_features, self.in_features).float()
            scales, zeros = (v.transpose(1, 2).reshape(-1, v.shape[1])[: self.out_features]
                             .repeat_interleave(self.group_size, dim=1) for v in (self.scales, self.zeros))
            buffer.copy_(scales * (q - zeros))
        else:
            linear_kernels.int4_dequantize(cpu_kernels.load(), self.weight, self.scales, self.zeros, self.group_size,
                                        buffer)
        return buffer if dtype == torch.bfloat16 else buffer.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"act_order={self.perm is not None}, bias={self.bias is not None}")
