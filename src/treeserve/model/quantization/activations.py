"""Layers whose inputs are quantized at run time as the checkpoint says (compressed-tensors W8A8).

- int8 W8A8 (`Int8W8A8Linear`): each row of the input scaled to int8 by its own absolute maximum
  (llm-compressor's rule: `scale = amax / 127.5`, values rounded half to even and clamped to
  [-128, 127]), multiplied by the int8 weights in int32 with `torch._int_mm` (oneDNN's VNNI kernel
  on CPU; any shape; see `Int8W8A8Linear._int_mm` for the operands' order), then scaled by the
  row's and the channel's scales.
- FP8 (`Fp8InputLinear`): a CPU has no FP8 units, so the weights are dequantized at load to the
  activations' dtype (a plain, oneDNN-packable linear), and each call rounds its input through
  float8_e4m3fn as the checkpoint's scheme does (per token `amax / 448`, or the stored static
  scale), so its results are the model's, not a float model's.
"""
from __future__ import annotations

import torch
from torch import nn

from treeserve.model.quantization.weights import IntWeight

INT8_HALF_RANGE = 127.5  # compressed-tensors: (127 - (-128)) / 2
FP8_MAX = 448.0


class Int8W8A8Linear(nn.Module):
    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        signed = (weight.values.to(torch.int16) - 128).to(torch.int8)
        self.weight = nn.Parameter(signed.contiguous(), requires_grad=False)  # [out, in]: see `_int_mm`
        self.scales = nn.Parameter(weight.scales[:, 0].float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, row_scales = quantize_rows_int8(rows)
        scaled = self._int_mm(quantized).float().mul_(self.scales[:, None]).mul_(row_scales.t())  # [out, rows]
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype).copy_(scaled.t())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _int_mm(self, quantized: torch.Tensor) -> torch.Tensor:
        """int32 products transposed, [out, rows]: weight @ rows^T, so that the few rows are the
        operand oneDNN reorders, not the weight (16384 x 2048, 2-core EPYC, a shared machine: 0.8-1.0 ms
        at 1 row against 2.3-3.7 for rows @ an [in, out] copy, 3.3 against 4.5 at 16; the bfloat16
        layer 2.5 and 3.6)."""
        return torch._int_mm(self.weight, quantized.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_rows_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scale per row [rows, 1]), symmetric per token."""
    amax = rows.abs().amax(dim=-1, keepdim=True).float()
    scales = amax / INT8_HALF_RANGE
    scales = torch.where(scales == 0, torch.finfo(torch.float32).eps, scales)
    quantized = torch.round(rows.float() / scales).clamp_(-128, 127).to(torch.int8)
    return quantized, scales


class Fp8InputLinear(nn.Module):
    """A linear layer (weights dequantized from FP8 at load) whose input is rounded through FP8."""

    def __init__(self, linear: nn.Linear, input_scale: torch.Tensor | None):
        super().__init__()
        self.linear = linear
        self.input_scale = None if input_scale is None else nn.Parameter(input_scale.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(round_through_fp8(x, self.input_scale))


def round_through_fp8(x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor:
    """x rounded to float8_e4m3fn under its scale (per token where no static scale) and back."""
    if static_scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = amax / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    else:
        scale = static_scale.to(x.dtype)
    rounded = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return rounded.to(x.dtype) * scale
