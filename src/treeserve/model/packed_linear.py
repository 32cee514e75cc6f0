"""bfloat16 linear layers on CPU: weights laid out once at load where the CPU has bfloat16 units,
float32 products over weights converted per call where it has none.

`F.linear` in bfloat16 on CPU runs a oneDNN matmul that reorders the weight into oneDNN's blocked
layout on every call; for the few rows of a decode step that reorder is a large part of the time.
Where treeserve's C kernels run (AVX512-BF16), `Bf16Linear` holds the weight in
csrc/bf16_linear.c's layout (blocks of 64 channels, each channel's pairs of inputs side by side,
streamed in order) and multiplies there: the products summed in float32 and rounded once, as
oneDNN's kernels do, in another order (one element in a few thousand differs from `F.linear` by one
bfloat16 unit). A decode step's linears of the ~150M benchmark model on a 2-core AVX512-BF16 EPYC
(`benchmarks/packed_linear.py`): 11.8 -> 9.1 ms at 1 row (20 -> 27 GB/s of weights), 12.2 -> 9.9 at 8,
15.4 -> 13.0 at 16, 42.6 -> 38.0 at 64, and a 2,048-token prefill's as fast as oneDNN's. Elsewhere
(no C compiler, or a CPU with AMX, whose tiles give oneDNN several times the vector units' rate
at prefill: not measured by us), `PackedLinear` keeps oneDNN's layout,
reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with
`_linear_pointwise`: a layer without bias gives results bit-identical to `F.linear`, faster (768x1280:
63 -> 35 us at 1 row). `F.linear` stays where neither helps: float32 (MKL runs it), a layer with a
bias where only oneDNN's layout is had (`F.linear` adds it in another order from a few hundred
rows on), a build or device without oneDNN, and a CPU without fast bfloat16 (AVX2 only: bfloat16
is not chosen there unless asked for).

On such a CPU, bfloat16 asked for anyway, `Float32Linear` converts the weight and input to
float32 for each call and rounds the product back: the same products (two bfloat16 numbers
multiply exactly in float32) summed in float32 as oneDNN's bfloat16 kernels do, in another order,
several times faster than those kernels there (a 2048x512 weight on a 2-core AVX2 EPYC: 10 ->
30 GFLOP/s at 16 rows, 14 -> 73 at 64), and the weights stay bfloat16 in memory. The converted
weight goes into a buffer kept per shape (`float32_weight`): a fresh one each call costs 2.6x the
conversion in page faults.
"""
from __future__ import annotations

import ctypes
import logging
import threading

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.config import cpu_has_amx, cpu_has_fast_bf16
from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.layers import GatedMLP

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


def _bias_free_linear(weight: torch.Tensor) -> nn.Linear:
    """An `nn.Linear` over `weight` [out, in] as it is (none allocated)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


def _reordered(linear: nn.Linear, order) -> nn.Linear:
    """An `nn.Linear` over `linear`'s weight and bias with their channels in `order(tensor)`'s order (copies)."""
    reordered = _bias_free_linear(order(linear.weight.detach()))
    if linear.bias is not None:
        reordered.bias = nn.Parameter(order(linear.bias.detach()), requires_grad=False)
    return reordered


def bf16_kernel() -> ctypes.CDLL | None:
    """treeserve's C library where its bfloat16 linear runs and is the one to use (AVX512-BF16 and no
    AMX: with AMX tiles oneDNN's matmuls have several times the vector units' rate), else None."""
    if cpu_has_amx():
        return None
    library = cpu_kernels.load()
    return library if linear_kernels.bf16_linear_supported(library) else None


class Bf16Linear(nn.Module):
    """An `nn.Linear`'s forward over its weight in csrc/bf16_linear.c's layout (`linear_kernels.bf16_pack`);
    the bias, if any, added in float32 before the one rounding. Made where `bf16_kernel()` is not None."""

    def __init__(self, linear: nn.Linear, in_place: bool = False):
        """`in_place`: the packed layout written over the linear's bfloat16 weight (which is garbage
        after it; see `linear_kernels.bf16_pack`)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.packed = nn.Parameter(linear_kernels.bf16_pack(weight, in_place), requires_grad=False)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of_weight(cls, weight: torch.Tensor, in_place: bool = False) -> "Bf16Linear":
        """The layer of a bias-free weight [out, in] (the weight itself is not kept; `in_place`: its
        bytes become the layout's)."""
        return cls(_bias_free_linear(weight), in_place)

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] as `nn.Linear` holds it (a copy, unpacked)."""
        return linear_kernels.bf16_unpack(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor, *epilogue) -> torch.Tensor:
        """`epilogue`: what a subclass's product takes besides the rows."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{type(self).__name__}: bfloat16 input expected, got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self._product(rows, *epilogue)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return linear_kernels.bf16_linear(cpu_kernels.load(), rows, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Bf16SiluMulLinear(Bf16Linear):
    """A SwiGLU MLP's gate-and-up `nn.Linear` [2 x size, hidden] whose forward returns the activation
    silu(gate) * up [..., size]: csrc/bf16_linear.c finishes each tile with it, so the [rows, 2 x
    size] products are neither stored nor read back (a 1k-token prefill of the 168M benchmark shape:
    0.8 ms a layer in `cpu_kernels.silu_mul`). The weight is packed with its channels grouped
    (`linear_kernels.gate_up_grouped`); `weight` gives it back in the gates-then-ups order."""

    applies_silu_mul = True

    def __init__(self, linear: nn.Linear):
        if linear.out_features % (2 * linear_kernels.GATE_UP_GROUP):
            raise ValueError(f"Bf16SiluMulLinear: {linear.out_features} channels, not twice a multiple of "
                             f"{linear_kernels.GATE_UP_GROUP}")
        self.size = linear.out_features // 2
        super().__init__(_reordered(linear, lambda t: linear_kernels.gate_up_grouped(t, self.size)))

    @property
    def weight(self) -> torch.Tensor:
        return linear_kernels.gate_up_ungrouped(super().weight, self.size)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return linear_kernels.bf16_linear_silu_mul(cpu_kernels.load(), rows, self.packed, self.bias, self.size)


class Bf16RotaryLinear(Bf16Linear):
    """An attention's q, k and v `nn.Linear` whose forward(x, positions, cos, sin) also applies the
    rotary embedding (rotate-half, float32 tables [*, head_dim] read at `positions`) to q's and k's
    heads: csrc/bf16_linear.c finishes each tile with the rotation, rounded as `cpu_kernels.rotary_`
    rounds it, so q and k are not read and written again (a 1k-token prefill of the 168M benchmark
    shape: ~0.5 ms a layer in `rotary_`). The weight is packed with q's and k's channels grouped
    (`linear_kernels.qkv_grouped`); `weight` gives it back in its own order. Made for an attention
    whose q and k go to the rotation as they come from the projection (no norm of each head between)."""

    applies_rotary = True

    def __init__(self, linear: nn.Linear, head_dim: int, rotary_channels: int):
        self.head_dim, self.rotary_channels = head_dim, rotary_channels
        super().__init__(_reordered(linear, lambda t: linear_kernels.qkv_grouped(t, rotary_channels, head_dim)))

    @property
    def weight(self) -> torch.Tensor:
        return linear_kernels.qkv_ungrouped(super().weight, self.rotary_channels, self.head_dim)

    def _product(self, rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return linear_kernels.bf16_linear_rotary(cpu_kernels.load(), rows, self.packed, self.bias, self.out_features,
                                                 positions, cos, sin, self.head_dim, self.rotary_channels)


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
        return cls(_bias_free_linear(weight))

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
    """Replaces the `nn.Linear`s of a bfloat16 model on a CPU with bfloat16 units (`can_pack`) by
    `Bf16Linear`s where the C kernel runs (every layer whose inputs come in pairs; a SwiGLU MLP's
    gate and up projections by a `Bf16SiluMulLinear` and an attention's q, k and v by a
    `Bf16RotaryLinear`, where their sizes allow), else by
    `PackedLinear`s (those without bias); or, bfloat16 on a CPU without bfloat16 units, every
    `nn.Linear` by a `Float32Linear`. Returns how many were replaced; a layer neither takes stays."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16():
        return _compute_in_float32(model)
    if not can_pack(dtype, device):
        return 0
    library = bf16_kernel()
    count = 0
    # the parents only: a list holding the linears too would keep each replaced weight alive until the
    # end (a second copy of every bfloat16 weight at the load's peak: 1.9 GB of a 1B model's)
    parents = [module for module in model.modules() if type(module) is not nn.Linear]
    for parent in parents:
        for name in [name for name, _ in parent.named_children()]:
            child = getattr(parent, name)
            if type(child) is nn.Linear and (packed := _packed(parent, name, child, library)) is not None:
                setattr(parent, name, packed)
                count += 1
            del child
    return count


def _packed(parent: nn.Module, name: str, linear: nn.Linear, library) -> nn.Module | None:
    if library is not None and linear.in_features % 2 == 0:
        return _with_epilogue(parent, name, linear) or Bf16Linear(linear)
    if linear.bias is not None:
        return None
    try:
        return PackedLinear(linear)
    except RuntimeError as exc:
        logger.warning("keeping %s as nn.Linear: oneDNN could not pack it (%s)", name, exc)
        return None


def _with_epilogue(parent: nn.Module, name: str, linear: nn.Linear) -> Bf16Linear | None:
    """The C kernel's layer that also does what follows the product where it can: a SwiGLU's
    activation, an attention's rotary embedding; else None."""
    if name == "gate_up_proj" and isinstance(parent, GatedMLP) and parent.act == "silu" \
            and parent.intermediate % linear_kernels.GATE_UP_GROUP == 0:
        return Bf16SiluMulLinear(linear)
    # (an attention's; decoder.py imports this module, so by its attribute)
    if name == "qkv_proj" and getattr(parent, "rotary_channels", 0) and parent.head_dim % 64 == 0:
        return Bf16RotaryLinear(linear, parent.head_dim, parent.rotary_channels)
    return None


def pack_tied_lm_head(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """A language model whose logits come from its embedding matrix (tied word embeddings) gets the
    matrix packed as its `lm_head`, where packing pays (`can_pack`): the logits are the step's
    largest product, and `F.linear` reorders the matrix on every call (Llama-3.2-1B's 128256 x 2048
    on a 2-core AVX512-BF16 EPYC: 27.9 -> 22.9 ms at 1 row with oneDNN's layout). In the C kernel's
    layout (`Bf16Linear`) the embedding's lookups read the same packed matrix (`PackedEmbedding`):
    held once. In oneDNN's (opaque) layout the embedding keeps its own, the matrix held twice, as
    vLLM's CPU path holds it (its embedding layer prepacks with `remove_weight=False`). Returns
    whether it packed."""
    if not can_pack(dtype, device) or getattr(model, "lm_head", True) is not None:
        return False
    if getattr(model, "head_name", None) is not None:  # a reward model: its head, not the embedding
        return False
    weight = model.embed_tokens.weight
    if bf16_kernel() is not None and weight.shape[1] % 2 == 0:
        # the embedding's own matrix becomes the layout where its lookups will read the layout (no
        # second 0.5 GB at load); a vocabulary-parallel embedding keeps its own rows
        shared = type(model.embed_tokens) is nn.Embedding
        in_place = shared and weight.dtype == torch.bfloat16 and weight.is_contiguous() \
            and weight.shape[0] % linear_kernels.BF16_PACK_BLOCK == 0
        model.lm_head = Bf16Linear.of_weight(weight, in_place)
        if shared:
            model.embed_tokens = PackedEmbedding(model.lm_head)
        return True
    try:
        model.lm_head = PackedLinear.of_weight(weight)
    except RuntimeError as exc:
        logger.warning("keeping the tied lm_head unpacked: oneDNN could not pack it (%s)", exc)
        return False
    return True


def checked_token_ids(input_ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """The ids flattened; an IndexError naming the range where one lies outside it (as nn.Embedding's)."""
    ids = input_ids.reshape(-1)
    if ids.numel():
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= num_embeddings:
            raise IndexError(f"token id out of range [0, {num_embeddings})")
    return ids


class PackedEmbedding(nn.Module):
    """Token embeddings read from a tied `Bf16Linear` head's packed matrix (the same parameter: the
    matrix is held and counted once). A token's row is its channel of the layout: the words of its
    block, one every 64 (a lookup's gather, negligible beside the step's products)."""

    def __init__(self, head: Bf16Linear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.packed = head.packed

    @property
    def weight(self) -> torch.Tensor:
        """The matrix [vocab, hidden] as `nn.Embedding` holds it (a copy, unpacked)."""
        return linear_kernels.bf16_unpack(self.packed, self.num_embeddings, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = checked_token_ids(input_ids, self.num_embeddings)
        rows = linear_kernels.gather_channels(self.packed, ids, self.embedding_dim, linear_kernels.BF16_PACK_BLOCK,
                                              torch.int32)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed with the lm_head"


def _compute_in_float32(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Float32Linear  # same parameters, the float32 forward
            count += 1
    return count
