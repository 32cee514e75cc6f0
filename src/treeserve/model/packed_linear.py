"""Linear layers whose weights oneDNN lays out once, for bfloat16 on CPU.

`F.linear` in bfloat16 on CPU runs a oneDNN matmul that reorders the weight into oneDNN's blocked
layout on every call; for the few rows of a decode step that reorder is a large part of the time.
Reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with
`_linear_pointwise`, a layer without bias gives results bit-identical to `F.linear`, faster:
768x1280 on an AVX512-BF16 CPU, 63 -> 35 us at 1 row, 165 -> 129 us at 24, 1236 -> 1166 us at 256
(`benchmarks/packed_linear.py`). `F.linear` stays where the two would differ or nothing is gained:
float32 (the last bits differ; MKL runs it), a layer with a bias (Qwen2's qkv: `F.linear` adds it
in another order from a few hundred rows on), a build or device without oneDNN, and a CPU without
fast bfloat16 (AVX2 only: bfloat16 is not chosen there unless asked for, and is slow either way).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from treeserve.config import cpu_has_fast_bf16

logger = logging.getLogger(__name__)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and cpu_has_fast_bf16())


class PackedLinear(nn.Module):
    """A bias-free `nn.Linear`'s forward over its weight in oneDNN's layout (an opaque tensor: it
    serves this forward only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("PackedLinear: only a layer without bias is exact (see the module's note)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.weight = nn.Parameter(packed, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replaces every `nn.Linear` without bias by a `PackedLinear` where that is exact and faster
    (see `can_pack`); returns how many were replaced. A layer oneDNN refuses stays as it was."""
    if not can_pack(dtype, device):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                try:
                    setattr(parent, name, PackedLinear(child))
                except RuntimeError as exc:
                    logger.warning("keeping %s as nn.Linear: oneDNN could not pack it (%s)", name, exc)
                    continue
                count += 1
    return count
