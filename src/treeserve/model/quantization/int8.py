"""Weight-only int8 with one scale per output channel: `--quantization int8` made at load from a
float or bfloat16 checkpoint (vLLM's and TGI's on-the-fly int8), and the 8-bit checkpoints
(GPTQ 8-bit, compressed-tensors W8A16) whose weights are symmetric with one group per channel.

On the fly, each output channel of every decoder-layer projection (attention qkv and output, the
MLP's gate/up and down) and of the LM head is scaled symmetrically to [-127, 127], `w ~= scale * q`
(llama.cpp's and MLX's int8 quantize the head too: at one row it is a fifth of a 1B model's bytes).
A tied head's embedding lookups read its int8 rows (int8_head.py). An untied embedding, a reward
head, MoE routers and experts stay as stored. With tensor parallelism each
rank quantizes its own shards, a row-parallel projection's (o_proj, down_proj) channels by the
largest weight of the whole row (`channel_amax`, read by the loader), so that the ranks' weights
are one rank's.

Products, by where they run:
- bfloat16 activations on a CPU with AVX512-BF16 and VNNI (inputs a multiple of 32): the weight is
  held only in csrc/int8_linear.c's packed layout (blocks of 64 channels, pairs of inputs side by
  side), and the rows enter as 16-bit integers under one power of two per 256 inputs (every
  element within 2^7 of its span's largest exact, the others within 2^-15 of it: under bfloat16's
  own rounding); widened weights times those by vpdpwssd, any number of rows (from 64 rows on at
  oneDNN's bfloat16 rate, so prefill needs no dequantized GEMM);
- elsewhere the row-major weight: treeserve's C kernel (`ts_int8_linear`, AVX512: tiles of 4 rows x
  4 channels, bfloat16 dot products where the CPU has them, float32 FMAs otherwise; PyTorch's
  `aten._weight_int8pack_mm` where it cannot run) for few rows, and from DEQUANTIZE_FROM_ROWS rows
  the weight dequantized once per call into a per-shape buffer for the activation dtype's GEMM.

Measured (2-core AMD EPYC with avx512_bf16 and avx512_vnni, bfloat16 rows): one 2048x8192 layer
(`benchmarks/quantization.py --kernels`, medians) packed 0.147 ms at 1 row against 0.235 row-major
and 1.19 for the stored bfloat16 layer (oneDNN, packed); 1.37 against 1.99 and 1.73 at 16 rows;
19.5 against 24.4 and 19.7 at 256 (the row-major layer's dequantized GEMM: 22.2). The 1B shape's
112 projections of one step (`benchmarks/quantized_step.py`, two runs): 32-34 ms at 1 row against
53 row-major and 87-90 bfloat16; 85-87 against 153-157 and 106 at 16 rows; 306-309 against 451-464
and 314-317 at 64. Since session 66 the packed kernel asks for the next span of weights into L2
(1.45x at 16 rows on a Zen 5 EPYC: 55 -> 38 ms for those 112). Whole models: docs/BENCHMARKS.md.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.packed_linear import scratch_weight

QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Rows from which a layer dequantizes its weight and runs the dense GEMM: 2048x8192 in bfloat16 on
# a 2-core AVX512-BF16 EPYC (benchmarks/quantization.py --kernels), the C kernel (bf16 dot products)
# 4.2 ms at 32 rows against 5.0 dequantized, 8.9 against 7.4 at 64
DEQUANTIZE_FROM_ROWS = 48
# A layer larger than this many weights (an LM head: Llama-3.2-1B's is 263 M) runs its dequantized GEMM in
# slices of channels this size: no float copy of it whole
SLICE_WEIGHTS = 32 << 20
# Weights quantized at a time (`quantize_channels`): its float32 temporaries (4 MiB each) stay in cache
# and in the heap. At 32 M (128 MiB temporaries, each mapped and faulted in anew) the 1B shape's int8 load
# took 7.8-7.9 s and peaked 0.4 GiB over what it holds; at 1 M 2.9-3.0 s and 0.02 GiB over
QUANTIZE_SLICE_WEIGHTS = 1 << 20
# PyTorch's int8 kernel crashed (segfault, torch 2.13 on CPU) on 40 input features; it runs only on
# widths that are a multiple of this (every real model's), other layers take the dequantized GEMM
ATEN_INT8_MULTIPLE = 64


class Int8Linear(nn.Module):
    """A linear layer over int8 weights with one scale per output channel (see the module's note)."""

    def __init__(self, linear: nn.Linear | None = None, *, quantized: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 channel_amax: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 pack: bool | None = None, consume: bool = False):
        """From a float `linear` (quantized here; `channel_amax`: each output channel's largest
        absolute weight where the linear holds a share of its inputs, a row-parallel rank's), or
        from a checkpoint's int8 weights [out, in] and their float32 scales [out]. `dtype`: the
        activations' (default: the linear's); `pack`: hold the weight in the packed kernel's layout
        only (default: where that kernel runs this dtype, see the module's note); `consume`: the
        packed layout may be written over `quantized` (no second copy at load)."""
        super().__init__()
        if linear is not None:
            quantized, scales = quantize_channels(linear.weight.detach(), channel_amax)
            bias, consume = linear.bias, True
            dtype = dtype or linear.weight.dtype
        self.out_features, self.in_features = quantized.shape
        self.packed = _packs(dtype, self.in_features) if pack is None else pack
        held = linear_kernels.int8_pack16(quantized, consume) if self.packed else quantized.contiguous()
        self.weight = nn.Parameter(held, requires_grad=False)
        self.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of_weight(cls, weight: torch.Tensor) -> "Int8Linear":
        """Quantized from a float matrix [out, in] (a tied LM head's embedding), for activations of its dtype."""
        quantized, scales = quantize_channels(weight.detach())
        return cls(quantized=quantized, scales=scales, dtype=weight.dtype, consume=True)

    def dequantized(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """scale x int8 of channels [start, stop) (default all) in `dtype`, in this thread's buffer for
        the shape (valid until the next call for that shape: use it at once)."""
        stop = self.out_features if stop is None else stop
        buffer = scratch_weight((stop - start, self.in_features), dtype, self.weight.device)
        weight = linear_kernels.int8_unpack16(self.weight, self.out_features, self.in_features) if self.packed \
            else self.weight
        weight, scales = weight[start:stop], self.scales[start:stop]
        library = cpu_kernels.library_for(buffer)
        if library is not None:
            return linear_kernels.int8_dequantize(library, weight, scales, buffer)
        return buffer.copy_(weight).mul_(scales.to(dtype)[:, None])

    def _dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """x times the dequantized weight: whole, or in slices of SLICE_WEIGHTS for a larger layer."""
        step = max(1, SLICE_WEIGHTS // self.in_features)
        if self.out_features <= step:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            bias = None if self.bias is None else self.bias[start:stop]
            out[..., start:stop] = F.linear(x, self.dequantized(x.dtype, start, stop), bias)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._packed_product(rows) if self.packed else self._row_major_product(rows)
        if out is None:
            return self._dequantized_product(x)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _packed_product(self, rows: torch.Tensor) -> torch.Tensor:
        """Any number of rows: the packed kernel runs at oneDNN's bfloat16 rate from 64 rows on."""
        if rows.dtype != torch.bfloat16 or rows.device.type != "cpu":
            raise RuntimeError(f"Int8Linear: its weights are packed for bfloat16 rows on CPU, not {rows.dtype} "
                               f"on {rows.device}")
        return linear_kernels.int8_linear_packed16(_packed_library(), rows if rows.stride(-1) == 1 else rows.contiguous(),
                                                self.weight, self.scales, self.out_features)

    def _row_major_product(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Few rows through a kernel (None: many rows, for the dequantized GEMM)."""
        if rows.shape[0] >= DEQUANTIZE_FROM_ROWS:
            return None
        out = None
        library = cpu_kernels.library_for(rows)
        if library is not None and rows.stride(-1) == 1:
            out = linear_kernels.int8_linear(library, rows, self.weight, self.scales)
        if out is None and self.in_features % ATEN_INT8_MULTIPLE == 0:  # no kernel of ours for it: PyTorch's
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales.to(rows.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed={self.packed}")


def quantize_channels(weight: torch.Tensor, channel_amax: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [out, in] and float32 scales [out] of a float matrix, each channel scaled by its largest
    absolute weight (or `channel_amax`'s) to [-127, 127]; QUANTIZE_SLICE_WEIGHTS at a time."""
    out_features, in_features = weight.shape
    quantized = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scales = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    step = max(1, QUANTIZE_SLICE_WEIGHTS // max(1, in_features))
    for start in range(0, out_features, step):
        part = weight[start:start + step].float()
        amax = part.abs().amax(dim=1) if channel_amax is None else channel_amax[start:start + step].float()
        scale = scales[start:start + step]
        torch.div(amax.clamp(min=1e-12), 127.0, out=scale)
        # (not in place: `part` is the caller's own weight where it is float32 already)
        quantized[start:start + step] = torch.round(part / scale[:, None]).clamp_(-127, 127)
    return quantized, scales


@functools.cache
def _packed_library():
    library = cpu_kernels.load()
    if library is None or library.ts_int8_rows16() != 1:
        raise RuntimeError("Int8Linear: its weights are packed for treeserve's CPU kernels, which do not run here")
    return library


def _packs(dtype: torch.dtype | None, in_features: int) -> bool:
    """Whether a layer holds its weight in the packed kernel's layout: bfloat16 activations on a
    CPU where that kernel runs (AVX512-BF16, VNNI), inputs a multiple of 32."""
    if dtype != torch.bfloat16 or in_features % 32:
        return False
    library = cpu_kernels.load()
    return library is not None and library.ts_int8_rows16() == 1


def quantize_linears(model: nn.Module, method: str | None, channel_amax: dict[str, torch.Tensor] | None = None) -> int:
    """With `method` "int8" (made on the fly), replaces the decoder layers' projections by
    `Int8Linear`s; returns how many. `channel_amax`: by module name (layers.0.self_attn.o_proj),
    the channels' largest weights of projections whose inputs are split over ranks."""
    if method != "int8":
        return 0
    count = 0
    # the parents only: a list holding the float linears too would keep every one alive until the end
    parents = [(name, module) for name, module in model.named_modules()
               if name.startswith("layers.") and type(module) is not nn.Linear]
    for parent_name, parent in parents:
        for name, child in list(parent.named_children()):
            if name in QUANTIZED_PROJECTIONS and type(child) is nn.Linear:
                amax = (channel_amax or {}).get(f"{parent_name}.{name}")
                setattr(parent, name, Int8Linear(child, channel_amax=amax))
                count += 1
    return count
