"""Layers whose inputs are quantized at run time as the checkpoint says (compressed-tensors W8A8).

- int8 W8A8 (`Int8W8A8Linear`): each row of the input scaled to int8 by its own absolute maximum
  (llm-compressor's rule: `scale = amax / 127.5`, values rounded half to even and clamped to
  [-128, 127]), multiplied by the int8 weights in int32, then scaled by the row's and the
  channel's scales. On a CPU with AVX512-VNNI all of it runs in treeserve's kernel
  (csrc/w8a8_linear.c: `vpdpbusd` tiles of 6 rows x 64 channels over weights packed at load);
  elsewhere the rows are quantized here and multiplied by `torch._int_mm` (see
  `Int8W8A8Linear._int_mm` for the operands' order). Both give the same bits.
  Measured (one layer, weights from memory, bfloat16 rows, 2-core EPYC with avx512_vnni): 8192 x 2048
  at 16 rows 0.96 ms against 1.89 through `torch._int_mm` and 2.66 for the bfloat16 `F.linear`;
  at 1 row 0.64 against 0.74; at 256 rows 11.7 against 15.1.
- FP8 (`Fp8InputLinear`): a CPU has no FP8 units, so the weights are dequantized at load to the
  activations' dtype (a plain, oneDNN-packable linear), and each call rounds its input through
  float8_e4m3fn as the checkpoint's scheme does (per token `amax / 448`, or the stored static
  scale), so its results are the model's, not a float model's.
"""
from __future__ import annotations

import torch
from torch import nn

from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.parallel import TensorParallel
from treeserve.model.quantization.weights import IntWeight

INT8_HALF_RANGE = 127.5  # compressed-tensors: (127 - (-128)) / 2
FP8_MAX = 448.0


class Int8W8A8Linear(nn.Module):
    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 split_inputs: TensorParallel | None = None):
        """`split_inputs`: the ranks holding the other shares of each input row (a row-parallel
        projection under tensor parallelism), whose largest value scales the row."""
        super().__init__()
        self.split_inputs = _across_ranks(split_inputs)
        self.out_features, self.in_features = weight.shape
        signed = (weight.values.to(torch.int16) - 128).to(torch.int8)
        self.scales = nn.Parameter(weight.scales[:, 0].float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        library = _vnni_library(self.in_features)
        if library is not None:  # the kernel's layout only: the weight is held once
            packed, comp = linear_kernels.w8a8_pack(signed, library.ts_w8a8_block_channels())
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.comp = nn.Parameter(comp, requires_grad=False)
        else:
            self.weight = nn.Parameter(signed.contiguous(), requires_grad=False)  # [out, in]: see `_int_mm`
            self.comp = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        row_scales = None if self.split_inputs is None else int8_row_scales(row_amax(rows, self.split_inputs))
        if self.comp is not None:
            out = self._vnni(rows, row_scales)
        else:
            quantized, row_scales = quantize_rows_int8(rows, row_scales)
            scaled = self._int_mm(quantized).float().mul_(self.scales[:, None]).mul_(row_scales.t())  # [out, rows]
            out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype).copy_(scaled.t())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _vnni(self, rows: torch.Tensor, row_scales: torch.Tensor | None) -> torch.Tensor:
        library = cpu_kernels.library_for(rows)
        if library is None:
            raise RuntimeError(f"Int8W8A8Linear: its weights are packed for the CPU kernel, which does not take "
                               f"{rows.dtype} rows on {rows.device}")
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        given = None if row_scales is None else row_scales.reshape(-1).contiguous()
        return linear_kernels.w8a8_linear(library, rows, self.weight, self.comp, self.scales, self.out_features, given)

    def _int_mm(self, quantized: torch.Tensor) -> torch.Tensor:
        """int32 products transposed, [out, rows]: weight @ rows^T, so that the few rows are the
        operand oneDNN reorders, not the weight (16384 x 2048, 2-core EPYC, a shared machine: 0.8-1.0 ms
        at 1 row against 2.3-3.7 for rows @ an [in, out] copy, 3.3 against 4.5 at 16; the bfloat16
        layer 2.5 and 3.6)."""
        return torch._int_mm(self.weight, quantized.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _across_ranks(split_inputs: TensorParallel | None) -> TensorParallel | None:
    """The ranks a row is split over, None where it is whole here."""
    return split_inputs if split_inputs is not None and split_inputs.enabled else None


def _vnni_library(in_features: int):
    """treeserve's CPU kernels where they run W8A8 here (AVX512-VNNI, inputs a multiple of 4), else None."""
    library = cpu_kernels.load()
    if library is None or library.ts_w8a8_supported() != 1 or in_features % 4:
        return None
    return library


def row_amax(rows: torch.Tensor, split_inputs: TensorParallel | None = None) -> torch.Tensor:
    """Each row's largest absolute value (float32 [rows, 1]), over every rank's share of the row."""
    amax = rows.abs().amax(dim=-1, keepdim=True).float()
    return amax if split_inputs is None else split_inputs.all_reduce_max(amax)


def int8_row_scales(amax: torch.Tensor) -> torch.Tensor:
    scales = amax / INT8_HALF_RANGE
    return torch.where(scales == 0, torch.finfo(torch.float32).eps, scales)


def quantize_rows_int8(rows: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scale per row [rows, 1]), symmetric per token: by each row's own largest
    value unless `scales` are given."""
    if scales is None:
        scales = int8_row_scales(row_amax(rows))
    quantized = torch.round(rows.float() / scales).clamp_(-128, 127).to(torch.int8)
    return quantized, scales


class Fp8InputLinear(nn.Module):
    """A linear layer (weights dequantized from FP8 at load) whose input is rounded through FP8."""

    def __init__(self, linear: nn.Linear, input_scale: torch.Tensor | None, split_inputs: TensorParallel | None = None):
        super().__init__()
        self.split_inputs = _across_ranks(split_inputs)
        self.linear = linear
        self.input_scale = None if input_scale is None else nn.Parameter(input_scale.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(round_through_fp8(x, self.input_scale, self.split_inputs))


def round_through_fp8(x: torch.Tensor, static_scale: torch.Tensor | None,
                      split_inputs: TensorParallel | None = None) -> torch.Tensor:
    """x rounded to float8_e4m3fn under its scale (per token, over every rank's share of the token,
    where no static scale) and back."""
    if static_scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        if split_inputs is not None:
            amax = split_inputs.all_reduce_max(amax.float()).to(x.dtype)
        scale = amax / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    else:
        scale = static_scale.to(x.dtype)
    rounded = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return rounded.to(x.dtype) * scale
