"""Python faces of treeserve's C linear kernels (csrc/int8_linear.c, int4_linear.c, w8a8_linear.c,
bf16_linear.c): the packed layouts the weights take at load and the calls that multiply rows by
them. The library itself is `cpu_kernels.load()`'s; these wrappers take it as their first argument.
"""
from __future__ import annotations

import ctypes

import torch

from treeserve.model.cpu_kernels import DTYPES, _rows


def int8_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [rows, K] (last dim contiguous) times (scales x weight)^T: weight int8 [N, K] contiguous,
    scales float32 [N]; [rows, N] in x's dtype, or None where the kernel cannot run it (no AVX512,
    K not a multiple of 16). bfloat16 rows go in as they are where the CPU has bf16 dot products
    (and K is a multiple of 32), else converted to float32 once, not per weight tile."""
    as_bf16 = x.dtype == torch.bfloat16 and library.ts_int8_bf16_rows(weight.shape[1]) == 1
    rows = x if as_bf16 or x.dtype == torch.float32 else x.float()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    status = library.ts_int8_linear(rows.data_ptr(), _rows(rows), int(as_bf16), weight.data_ptr(), scales.data_ptr(),
                                    out.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1], DTYPES[x.dtype])
    return out if status == 0 else None


def int8_dequantize(library: ctypes.CDLL, weight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """scales[n] x weight[n, k] into `out` (contiguous, float32 or bfloat16, weight's shape)."""
    library.ts_int8_dequantize(weight.data_ptr(), scales.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1],
                               DTYPES[out.dtype])
    return out


INT8_PACK16_BLOCK = 64  # channels per block of csrc/int8_linear.c's packed layout
PACK_CHUNK_BYTES = 8 << 20  # weight bytes packed at a time (`_interleave_channels`)


def int8_pack16(weight: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """int8 weights [N, K] (K a multiple of 32) in csrc/int8_linear.c's packed layout: int8
    [ceil(N / 64) * 64 * K], blocks of 64 channels, in each the pairs of inputs' two bytes side by
    side for every channel (zero channels past N). `in_place`: written over the weight's bytes where
    N is a multiple of 64 and the weight contiguous (see `_interleave_channels`), else a new tensor."""
    if weight.shape[1] % 32:
        raise ValueError(f"int8_pack16: {weight.shape[1]} inputs, not a multiple of 32")
    in_place = in_place and weight.shape[0] % INT8_PACK16_BLOCK == 0 and weight.is_contiguous()
    return _interleave_channels(weight, INT8_PACK16_BLOCK, torch.int16, in_place)


def _interleave_channels(weight: torch.Tensor, block: int, word: torch.dtype, in_place: bool = False) -> torch.Tensor:
    """int8 [N, K] in blocks of `block` channels, in each the channels' next `word`-sized run of
    inputs side by side: int8 [ceil(N / block) * block * K], zero channels past N. The runs move as
    one element each (a quarter or half of the bytes' count); a few MiB of blocks at a time, so that
    packing needs no more than the packed result beside the weight (an LM head is 0.5 GB). `in_place`
    (N a multiple of `block`, the weight contiguous): the result is written over the weight's own
    bytes, each chunk copied out first (a block's channels fill the bytes of its packed form), so
    that packing needs nothing beside the weight; the weight is garbage after it."""
    n, k = weight.shape
    blocks = -(-n // block)
    if in_place and (n % block or not weight.is_contiguous()):
        raise ValueError(f"packing in place needs a contiguous weight of a multiple of {block} channels, "
                         f"got {tuple(weight.shape)}")
    runs = weight.contiguous().view(word)  # [N, runs]
    out = runs.view(blocks, block, -1) if in_place else torch.empty(blocks, runs.shape[1], block, dtype=word)
    out = out.view(blocks, runs.shape[1], block)
    step = max(1, PACK_CHUNK_BYTES // (block * k))
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        rows = runs[b0 * block:b1 * block]
        rows = rows.clone() if in_place else rows
        if rows.shape[0] < (b1 - b0) * block:  # the last block short: zero channels past N
            rows = torch.cat([rows, rows.new_zeros((b1 - b0) * block - rows.shape[0], rows.shape[1])])
        out[b0:b1] = rows.view(b1 - b0, block, -1).transpose(1, 2)
    return out.view(torch.int8).reshape(-1)


def int8_linear_packed16(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                         out_features: int) -> torch.Tensor:
    """x [rows, K] bfloat16 (last dim contiguous) as 16-bit integers (a power of two per 256
    inputs) times the `int8_pack16`ed weight and its float32 channel scales: [rows, N] bfloat16."""
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    status = library.ts_int8_linear_packed16(x.data_ptr(), _rows(x), packed.data_ptr(), scales.data_ptr(),
                                             out.data_ptr(), x.shape[0], out_features, x.shape[1])
    if status == -2:
        raise MemoryError("int8_linear_packed16: no memory for the rows as 16-bit integers")
    if status != 0:
        raise ValueError(f"int8_linear_packed16: cannot run {x.dtype} rows of {x.shape[1]} inputs here")
    return out


def gather_channels(packed: torch.Tensor, ids: torch.Tensor, k: int, block: int, word: torch.dtype) -> torch.Tensor:
    """Channels `ids` of a layout of blocks of `block` channels with `word`-sized runs of their k
    inputs side by side (`_interleave_channels`') as rows [len(ids), k] of `packed`'s dtype: a
    token's embedding from a tied head's packed matrix (a gather of its runs, one every `block`)."""
    runs = k * packed.element_size() // torch.empty(0, dtype=word).element_size()
    words = packed.view(word).view(-1, runs, block)
    return words[ids // block, :, ids % block].view(packed.dtype)


def int8_unpack16(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """An `int8_pack16`ed weight back as int8 [n, k]."""
    pairs = packed.view(torch.int16).reshape(-1, k // 2, INT8_PACK16_BLOCK)
    return pairs.transpose(1, 2).contiguous().view(torch.int8).reshape(-1, k)[:n]


BF16_PACK_BLOCK = 64  # channels per block of csrc/bf16_linear.c's layout


def bf16_linear_supported(library: ctypes.CDLL | None) -> bool:
    """Whether `bf16_linear` runs here (the library built, the CPU with AVX512-BF16)."""
    return library is not None and library.ts_bf16_linear_supported() == 1


def bf16_pack(weight: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """bfloat16 weights [N, K] (K even) in csrc/bf16_linear.c's layout: bfloat16
    [ceil(N / 64) * 64 * K], blocks of 64 channels, in each every channel's next pair of inputs
    side by side (zero channels past N). `in_place`: written over the weight's bytes (see
    `_interleave_channels`)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"bf16_pack: expected bfloat16 [N, K] with K even, got {weight.dtype} {tuple(weight.shape)}")
    bytes_ = weight.view(torch.int8) if in_place else weight.contiguous().view(torch.int8)
    return _interleave_channels(bytes_, BF16_PACK_BLOCK, torch.int32, in_place).view(torch.bfloat16)


def bf16_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A `bf16_pack`ed weight back as bfloat16 [n, k]."""
    pairs = packed.view(torch.int32).reshape(-1, k // 2, BF16_PACK_BLOCK)
    return pairs.transpose(1, 2).contiguous().view(torch.bfloat16).reshape(-1, k)[:n]


def bf16_linear(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [rows, K] bfloat16 (last dim contiguous) times the `bf16_pack`ed weight (+ bias, bfloat16
    [N] contiguous): [rows, N] bfloat16, summed in float32 and rounded once."""
    return _bf16_call(library.ts_bf16_linear, x, packed, bias, out_features)


def _bf16_call(kernel, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, width: int,
               *extra) -> torch.Tensor:
    """[rows, width] bfloat16 from one of csrc/bf16_linear.c's entries (`extra`: its arguments after
    the common ones)."""
    out = torch.empty((x.shape[0], width), dtype=torch.bfloat16)
    status = kernel(x.data_ptr(), _rows(x), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                    out.data_ptr(), x.shape[0], width, x.shape[1], *extra)
    if status == -2:
        raise MemoryError(f"{kernel.__name__}: no memory for the partial sums")
    if status != 0:
        raise ValueError(f"{kernel.__name__}: cannot run {x.shape[1]} inputs and {width} channels on this CPU")
    return out


GATE_UP_GROUP = 32  # gates, then the same channels' ups, per block of 64 (`gate_up_grouped`)


def gate_up_grouped(t: torch.Tensor, size: int) -> torch.Tensor:
    """A gate-and-up weight or bias [2 x size, ...] (the gates, then the ups) reordered into groups of
    32 gates each followed by the same channels' ups (size a multiple of 32): a copy."""
    if t.shape[0] != 2 * size or size % GATE_UP_GROUP:
        raise ValueError(f"gate_up_grouped: expected {2 * size} channels, a multiple of 64, got {t.shape[0]}")
    rest = t.shape[1:]
    return t.reshape(2, size // GATE_UP_GROUP, GATE_UP_GROUP, *rest).transpose(0, 1).reshape(2 * size, *rest)


def gate_up_ungrouped(t: torch.Tensor, size: int) -> torch.Tensor:
    """`gate_up_grouped` undone: the gates, then the ups."""
    rest = t.shape[1:]
    return t.reshape(size // GATE_UP_GROUP, 2, GATE_UP_GROUP, *rest).transpose(0, 1).reshape(2 * size, *rest)


def bf16_linear_silu_mul(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         size: int) -> torch.Tensor:
    """silu(gate) * up [rows, size] bfloat16 of x [rows, K] bfloat16 (last dim contiguous) and a
    gate-and-up weight [2 x size, K] packed as `bf16_pack(gate_up_grouped(weight, size))` (bias, if
    any, grouped alike): the products rounded once, then the activation rounded as
    `cpu_kernels.silu_mul`'s, the [rows, 2 x size] products never stored."""
    return _bf16_call(library.ts_bf16_linear_silu_mul, x, packed, bias, size)


def qkv_grouped(t: torch.Tensor, rotary_channels: int, head_dim: int) -> torch.Tensor:
    """A q, k and v weight or bias [channels, ...] with the first `rotary_channels` (q's and k's heads)
    reordered per head into blocks of 64: dimensions 32 t + [0, 32) of the head's first half, then the
    same of its second half (the pairs rotate-half mixes), t = 0 .. head_dim / 64 - 1; v's as they are.
    A copy."""
    if head_dim % 64 or rotary_channels % head_dim or rotary_channels > t.shape[0]:
        raise ValueError(f"qkv_grouped: {rotary_channels} rotary channels of {t.shape[0]} in heads of {head_dim}")
    rest, heads, half = t.shape[1:], rotary_channels // head_dim, head_dim // 2
    rotated = t[:rotary_channels].reshape(heads, 2, half // 32, 32, *rest).transpose(1, 2)
    return torch.cat([rotated.reshape(rotary_channels, *rest), t[rotary_channels:]])


def qkv_ungrouped(t: torch.Tensor, rotary_channels: int, head_dim: int) -> torch.Tensor:
    """`qkv_grouped` undone."""
    rest, heads, half = t.shape[1:], rotary_channels // head_dim, head_dim // 2
    rotated = t[:rotary_channels].reshape(heads, half // 32, 2, 32, *rest).transpose(1, 2)
    return torch.cat([rotated.reshape(rotary_channels, *rest), t[rotary_channels:]])


def bf16_linear_rotary(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                       out_features: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       head_dim: int, rotary_channels: int) -> torch.Tensor:
    """x [rows, K] bfloat16 (last dim contiguous) times a q, k and v weight packed as
    `bf16_pack(qkv_grouped(weight, rotary_channels, head_dim))` (bias, if any, grouped alike): [rows,
    out_features] bfloat16 in the weight's own channel order, q's and k's channels rotated at each row's
    table row `positions` (int64) of cos and sin (float32 [*, head_dim]), rounded as `cpu_kernels.rotary_`
    rounds the product."""
    if positions.dtype != torch.long or positions.shape != (x.shape[0],) or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32 or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        raise ValueError("bf16_linear_rotary: int64 positions, one per row, and float32 tables [*, head_dim]")
    positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
    return _bf16_call(library.ts_bf16_linear_rotary, x, packed, bias, out_features, positions.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), head_dim, rotary_channels)


INT4_RUN = 128  # inputs per run of csrc/int4_linear.c's layout


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [N, K] (any integer dtype, 0..15; K a multiple of 32) in csrc/int4_linear.c's
    layout: 16-bit words [N, 32 * ceil(K / 128)], in each run of 128 inputs word i holding inputs i,
    i + 32, i + 64, i + 96 in its nibbles from the lowest (zeros past K)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4_pack: {k} inputs, not a multiple of 32")
    padded = torch.zeros(n, -(-k // INT4_RUN) * INT4_RUN, dtype=torch.int32)
    padded[:, :k] = q
    runs = padded.reshape(n, -1, 4, INT4_RUN // 4)
    words = runs[:, :, 0] | (runs[:, :, 1] << 4) | (runs[:, :, 2] << 8) | (runs[:, :, 3] << 12)
    return words.to(torch.uint16).reshape(n, -1).contiguous()


def int4_linear(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """x [rows, K] bfloat16 (last dim contiguous) times w^T, w [N, K] = scales[n, g] x (q - zeros[n, g])
    with q in `int4_pack`'s layout and scales, zeros float32 [N, K / group_size] contiguous; [rows, N]
    bfloat16, or None where the kernel cannot run it (no AVX512-BF16, float32 rows, a group size
    that is not a multiple of 32 or does not divide K)."""
    if x.dtype != torch.bfloat16 or library.ts_int4_supported() != 1:
        return None
    out = torch.empty((x.shape[0], packed.shape[0]), dtype=torch.bfloat16)
    status = library.ts_int4_linear(x.data_ptr(), _rows(x), packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                    out.data_ptr(), x.shape[0], packed.shape[0], x.shape[1], group_size)
    if status == -2:
        raise MemoryError("int4_linear: no memory for the rows' group sums")
    return out if status == 0 else None


INT4_PACK16_BLOCK = 64  # channels per block of csrc/int4_linear.c's packed layout


def int4_pack16(q: torch.Tensor, blocks_at_once: int = 16) -> torch.Tensor:
    """4-bit values q [N, K] (0..15; K a multiple of 32) in csrc/int4_linear.c's packed layout: uint8
    [ceil(N / 64) * 64 * K / 2], blocks of 64 channels, in each for every four inputs k .. k + 3
    each channel's bytes q[k] | q[k + 2] << 4 and q[k + 1] | q[k + 3] << 4 (zero channels past N).
    Packed `blocks_at_once` blocks at a time: a load holds the values and the packed bytes, not
    copies of the values (a 128k-vocabulary head's are 0.26 GB)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4_pack16: {k} inputs, not a multiple of 32")
    blocks = -(-n // INT4_PACK16_BLOCK)
    out = torch.empty(blocks, k // 4, INT4_PACK16_BLOCK, 2, dtype=torch.uint8)
    for first in range(0, blocks, blocks_at_once):
        last = min(blocks, first + blocks_at_once)
        rows = q[first * INT4_PACK16_BLOCK:last * INT4_PACK16_BLOCK]
        if rows.shape[0] < (last - first) * INT4_PACK16_BLOCK:  # the last block: zero channels past N
            rows = torch.cat([rows, rows.new_zeros((last - first) * INT4_PACK16_BLOCK - rows.shape[0], k)])
        quads = rows.reshape(last - first, INT4_PACK16_BLOCK, k // 4, 4)
        out[first:last] = (quads[..., :2] | (quads[..., 2:] << 4)).permute(0, 2, 1, 3)
    return out.reshape(-1)


def int4_unpack16(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """An `int4_pack16`ed weight back as 4-bit values uint8 [n, k]."""
    pairs = packed.reshape(-1, k // 4, INT4_PACK16_BLOCK, 2).permute(0, 2, 1, 3)
    quads = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)  # [blocks, 64, K / 4, 4]
    return quads.reshape(-1, k)[:n]


def int4_pack16_groups(values: torch.Tensor) -> torch.Tensor:
    """Scales or zero points [N, groups] as the packed kernel reads them, by block of 64 channels:
    float32 [blocks, groups, 64] (zeros past N)."""
    n, groups = values.shape
    blocks = -(-n // INT4_PACK16_BLOCK)
    padded = torch.zeros(blocks * INT4_PACK16_BLOCK, groups, dtype=torch.float32)
    padded[:n] = values
    return padded.reshape(blocks, INT4_PACK16_BLOCK, groups).transpose(1, 2).contiguous()


def int4_linear_packed16(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales_t: torch.Tensor,
                         zeros_t: torch.Tensor, out_features: int, group_size: int) -> torch.Tensor:
    """x [rows, K] bfloat16 (last dim contiguous) as 16-bit integers times the `int4_pack16`ed weight,
    w = scale x (q - zero) with `int4_pack16_groups`' scales and zero points: [rows, N] bfloat16."""
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    status = library.ts_int4_linear_packed16(x.data_ptr(), _rows(x), packed.data_ptr(), scales_t.data_ptr(),
                                             zeros_t.data_ptr(), out.data_ptr(), x.shape[0], out_features, x.shape[1],
                                             group_size)
    if status == -2:
        raise MemoryError("int4_linear_packed16: no memory for the rows as 16-bit integers")
    if status != 0:
        raise ValueError(f"int4_linear_packed16: cannot run {x.shape[1]} inputs in groups of {group_size} here")
    return out


def int4_dequantize(library: ctypes.CDLL, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, out: torch.Tensor) -> torch.Tensor:
    """`int4_linear`'s weight, scales x (q - zeros) rounded once, into `out` (bfloat16 [N, K], contiguous)."""
    library.ts_int4_dequantize(packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(), out.shape[0],
                               out.shape[1], group_size)
    return out


def w8a8_pack(weight: torch.Tensor, block_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [N, K] (K a multiple of 4) in csrc/w8a8_linear.c's layout, int8
    [ceil(N / block) * block * K] (zero channels past N), and each channel's correction
    128 x sum_k w[n, k] (int32 [N])."""
    if weight.shape[1] % 4:
        raise ValueError(f"w8a8_pack: {weight.shape[1]} inputs, not a multiple of 4")
    packed = _interleave_channels(weight, block_channels, torch.int32)
    comp = (weight.to(torch.int32).sum(dim=1) * 128).to(torch.int32).contiguous()
    return packed, comp


def w8a8_linear(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, comp: torch.Tensor,
                scales: torch.Tensor, out_features: int, row_scales: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [rows, K] (float32 or bfloat16, last dim contiguous), each row quantized to int8 by its
    absolute maximum (`quantization.activations.quantize_rows_int8`, to the bit) or under
    `row_scales` (float32 [rows], contiguous) where given, times the `w8a8_pack`ed int8 weight and
    its float32 channel scales; [rows, N] in x's dtype, or None where the kernel cannot run (no
    AVX512-VNNI)."""
    if library.ts_w8a8_supported() != 1:
        return None
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    given = None if row_scales is None else row_scales.data_ptr()
    status = library.ts_w8a8_linear(x.data_ptr(), _rows(x), packed.data_ptr(), comp.data_ptr(), scales.data_ptr(),
                                    given, out.data_ptr(), x.shape[0], out_features, x.shape[1], DTYPES[x.dtype])
    if status == -2:
        raise MemoryError("w8a8_linear: no memory for the quantized rows")
    return out if status == 0 else None
