"""bfloat16 linear layers on CPU: weights oneDNN lays out once where the CPU has bfloat16 units,
float32 products over weights converted per call where it has none.

`F.linear` in bfloat16 on CPU runs a oneDNN matmul that reorders the weight into oneDNN's blocked
layout on every call; for the few rows of a decode step that reorder is a large part of the time.
Reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with
`_linear_pointwise`, a layer without bias gives results bit-identical to `F.linear`, faster:
768x1280 on an AVX512-BF16 CPU, 63 -> 35 us at 1 row, 165 -> 129 us at 24, 1236 -> 1166 us at 256
(`benchmarks/packed_linear.py`). `F.linear` stays where the two would differ or nothing is gained:
float32 (the last bits differ; MKL runs it), a layer with a bias (Qwen2's qkv: `F.linear` adds it
in another order from a few hundred rows on), a build or device without oneDNN, and a CPU without
fast bfloat16 (AVX2 only: bfloat16 is not chosen there unless asked for).

On such a CPU, bfloat16 asked for anyway, `Float32Linear` converts the weight and input to
float32 for each call and rounds the product back: the same products (two bfloat16 numbers
multiply exactly in float32) summed in float32 as oneDNN's bfloat16 kernels do, in another order,
several times faster than those kernels there (a 2048x512 weight on a 2-core AVX2 EPYC: 10 ->
30 GFLOP/s at 16 rows, 14 -> 73 at 64), and the weights stay bfloat16 in memory. The converted
weight goes into a buffer kept per shape (`float32_weight`): a fresh one each call costs 2.6x the
conversion in page faults.
"""
from __future__ import annotations

import logging
import threading

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.config import cpu_has_fast_bf16

logger = logging.getLogger(__name__)


_scratch = threading.local()


def scratch_weight(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's buffer for a weight of this shape and dtype, made once: valid until the next
    call for that shape (use it at once)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (tuple(shape), dtype, device)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(shape, dtype=dtype, device=device)
    return buffer


def float32_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` converted to float32 in this thread's buffer for its shape (see `scratch_weight`)."""
    return scratch_weight(weight.shape, torch.float32, weight.device).copy_(weight)


def computes_in_float32(x: torch.Tensor) -> bool:
    """Whether bfloat16 products with `x` run in float32 (a CPU without bfloat16 units)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_has_fast_bf16()


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

    @classmethod
    def of_weight(cls, weight: torch.Tensor) -> "PackedLinear":
        """The packed layer of a bias-free weight [out, in] (the weight itself is not kept)."""
        with torch.device("meta"):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        return cls(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


class Float32Linear(nn.Linear):
    """An `nn.Linear` in bfloat16 whose product runs in float32 (see the module's note)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), float32_weight(self.weight), bias).to(x.dtype)


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replaces every `nn.Linear` without bias by a `PackedLinear` where that is exact and faster
    (see `can_pack`), or, bfloat16 on a CPU without bfloat16 units, every `nn.Linear` by a
    `Float32Linear`; returns how many were replaced. A layer oneDNN refuses stays as it was."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16():
        return _compute_in_float32(model)
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


def pack_tied_lm_head(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """A language model whose logits come from its embedding matrix (tied word embeddings) gets a
    packed copy of it as its `lm_head`, where packing pays (`can_pack`): the logits are the step's
    largest product, and `F.linear` reorders the matrix on every call (Llama-3.2-1B's 128256 x 2048
    on a 2-core AVX512-BF16 EPYC: 27.9 -> 22.9 ms at 1 row, 41.4 -> 30.5 at 16; the same bits).
    The embedding keeps its own for lookups: the matrix is held twice, as vLLM's CPU path holds it
    (its embedding layer prepacks with `remove_weight=False`). Returns whether it packed."""
    if not can_pack(dtype, device) or getattr(model, "lm_head", True) is not None:
        return False
    if getattr(model, "head_name", None) is not None:  # a reward model: its head, not the embedding
        return False
    try:
        model.lm_head = PackedLinear.of_weight(model.embed_tokens.weight)
    except RuntimeError as exc:
        logger.warning("keeping the tied lm_head unpacked: oneDNN could not pack it (%s)", exc)
        return False
    return True


def _compute_in_float32(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Float32Linear  # same parameters, the float32 forward
            count += 1
    return count
