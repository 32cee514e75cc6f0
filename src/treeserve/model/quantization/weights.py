"""One projection's quantized weight as read from a checkpoint, in one form whatever the format.

Every integer format (GPTQ, AWQ, compressed-tensors pack- and int-quantized) decodes to
`IntWeight`: unsigned values `q` in [0, 2**bits), one scale and one zero point per output channel
and group of input features, `w = (q - zero) * scale`; groups are `group_size` consecutive input
features unless the checkpoint's `g_idx` says otherwise (GPTQ's act order). FP8 checkpoints decode to
`FloatWeight` (the dequantized weight). The fused projections (qkv, gate_up) concatenate their parts
here, rows with their scales and zero points, before a layer is chosen for them (`layers.py`).

With tensor parallelism each rank holds a slice of each weight, cut here in the weight's own terms
(`rows`, `columns`), since packed words and per-group scales cannot be sliced as read: output
channels of a column-parallel projection, input features of a row-parallel one with the groups
they read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class IntWeight:
    values: torch.Tensor   # uint8 [out, in], each in [0, 2**bits)
    scales: torch.Tensor   # float32 [out, groups]
    zeros: torch.Tensor    # float32 [out, groups], in the values' units
    bits: int
    group_size: int        # input features per group (in_features: one group per output channel)
    g_idx: torch.Tensor | None = None  # int64 [in]: each input feature's group, where not i // group_size
    input_quant: str | None = None      # "int8_token": W8A8, activations quantized per token at run time

    def __post_init__(self):
        out_features, in_features = self.values.shape
        groups = -(-in_features // self.group_size) if self.g_idx is None else int(self.g_idx.max()) + 1
        if self.scales.shape != (out_features, groups) or self.zeros.shape != self.scales.shape:
            raise ValueError(f"{out_features} x {in_features} weights in groups of {self.group_size} need "
                             f"{(out_features, groups)} scales and zeros, not {tuple(self.scales.shape)} and "
                             f"{tuple(self.zeros.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def groups_of_inputs(self) -> torch.Tensor:
        """Each input feature's group (int64 [in])."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.values.shape[1]) // self.group_size

    def rows(self, start: int, end: int) -> IntWeight:
        """Output channels [start, end) with their scales and zero points (copies: the whole goes)."""
        return replace(self, values=self.values[start:end].clone(), scales=self.scales[start:end].clone(),
                       zeros=self.zeros[start:end].clone())

    def columns(self, start: int, end: int) -> IntWeight:
        """Input features [start, end) and the groups they read. Without act order the cut must fall
        on group boundaries (a ValueError names the group size otherwise); in act order the features
        keep their groups, renumbered among those they read, and since a group's features lie on
        several ranks they are no longer runs of group_size (`groups_are_runs_when_sorted`): the
        slice runs dequantized, as vLLM's exllama path falls back for such shards."""
        values = self.values[:, start:end].clone()
        if self.g_idx is not None:
            used, g_idx = torch.unique(self.g_idx[start:end], return_inverse=True)
            return replace(self, values=values, scales=self.scales[:, used].contiguous(),
                           zeros=self.zeros[:, used].contiguous(), g_idx=g_idx)
        if self.scales.shape[1] == 1:  # one group per channel: the slice's features are all of it
            return replace(self, values=values, scales=self.scales.clone(), zeros=self.zeros.clone(),
                           group_size=end - start)
        in_features = self.values.shape[1]
        if start % self.group_size or (end % self.group_size and end != in_features):
            raise ValueError(f"input features [{start}, {end}) do not fall on its groups of {self.group_size}")
        groups = slice(start // self.group_size, -(-end // self.group_size))
        return replace(self, values=values, scales=self.scales[:, groups].clone(), zeros=self.zeros[:, groups].clone())

    def symmetric(self) -> bool:
        return bool((self.zeros == 2 ** (self.bits - 1)).all())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        groups = self.groups_of_inputs()
        weight = (self.values.float() - self.zeros[:, groups]) * self.scales[:, groups]
        return weight.to(dtype)

    def groups_are_runs_when_sorted(self) -> bool:
        """Whether sorting the input features by group gives runs of `group_size` (GPTQ's act order
        does; a checkpoint's odd g_idx may not, and then runs dequantized)."""
        if self.g_idx is None:
            return True
        expected = torch.arange(len(self.g_idx)) // self.group_size
        return torch.equal(torch.sort(self.g_idx).values, expected)

    def in_act_order(self) -> tuple[IntWeight, torch.Tensor] | None:
        """(this weight with its input features sorted by group, so that groups are consecutive runs,
        the permutation to apply to the inputs), or None where they are consecutive already."""
        if self.g_idx is None:
            return None
        if not self.groups_are_runs_when_sorted():
            raise ValueError("g_idx does not split the input features into runs of group_size")
        perm = torch.argsort(self.g_idx, stable=True)
        return replace(self, values=self.values[:, perm].contiguous(), g_idx=None), perm


@dataclass(frozen=True)
class FloatWeight:
    """A weight dequantized at load (FP8), with how its inputs are quantized at run time."""
    weight: torch.Tensor                 # float32 [out, in]
    input_quant: str | None = None       # "fp8_token" (dynamic per token) or "fp8_tensor" (static)
    input_scale: torch.Tensor | None = None  # float32 scalar, "fp8_tensor"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def rows(self, start: int, end: int) -> FloatWeight:
        return replace(self, weight=self.weight[start:end].clone())

    def columns(self, start: int, end: int) -> FloatWeight:
        """Input features [start, end); a static input scale stays the tensor's (it scales every feature)."""
        return replace(self, weight=self.weight[:, start:end].clone())


def concat_rows(parts: list[IntWeight | FloatWeight]) -> IntWeight | FloatWeight:
    """The fused projection of `parts` (q, k, v or gate, up), each part's output channels in order.
    Parts that disagree on their format (bits, groups, act order) fuse dequantized."""
    first = parts[0]
    if all(isinstance(p, IntWeight) for p in parts) and _same_layout(parts):
        return replace(first, values=torch.cat([p.values for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       zeros=torch.cat([p.zeros for p in parts]))
    if all(isinstance(p, FloatWeight) for p in parts) and len({p.input_quant for p in parts}) == 1:
        scales = [p.input_scale for p in parts if p.input_scale is not None]
        # one static input scale for the fused layer: the largest (vLLM's choice), so nothing clips
        scale = torch.stack(scales).max() if scales else None
        return FloatWeight(torch.cat([p.weight for p in parts]), first.input_quant, scale)
    if any(p.input_quant is not None for p in parts):  # dequantized, their inputs would no longer be quantized
        raise ValueError("the parts of a fused projection quantize their inputs differently: "
                         f"{[p.input_quant for p in parts]}")
    return FloatWeight(torch.cat([p.dequantize() for p in parts]))


def _same_layout(parts: list[IntWeight]) -> bool:
    first = parts[0]
    for part in parts[1:]:
        if (part.bits, part.group_size, part.input_quant) != (first.bits, first.group_size, first.input_quant):
            return False
        if (part.g_idx is None) != (first.g_idx is None):
            return False
        if part.g_idx is not None and not torch.equal(part.g_idx, first.g_idx):
            return False
    return True
