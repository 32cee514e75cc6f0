"""treeserve's own CPU kernels (`csrc/cpu_kernels.c`): built with the system C compiler on first
use, cached by source, flags and CPU, and called through ctypes.

Built `-O3 -march=native -fopenmp`: about a second with gcc, once per machine (the library lands
in `<cache>/kernels/`). Its OpenMP is the libgomp PyTorch has loaded, so the kernels run on
PyTorch's threads. Where there is no compiler, the build fails, or `TREESERVE_CPU_KERNELS=0`,
`load()` answers None (logged once, with the reason) and callers keep their PyTorch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from treeserve.model.registry import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in (
    "cpu_kernels.c", "paged_decode.c", "flash_prefill.c", "int8_linear.c", "int4_linear.c", "w8a8_linear.c",
    "bf16_linear.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math",
         f"-I{CSRC}"]
LIBS = ["-lm"]  # after the source: linkers that drop unneeded libraries look at what precedes them
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # as in the source

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_float = ctypes.c_float
SIGNATURES = {
    "ts_paged_attention": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _int, _ptr, _ptr, _ptr, _i64, _int, _int, _int,
                        _float, _i64, _float, _int, _ptr],
    "ts_rms_norm": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _float, _int],
    "ts_silu_mul": [_ptr, _i64, _ptr, _i64, _i64, _int],
    "ts_rotary": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _int, _int, _int],
    "ts_write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _int],
    "ts_int8_linear": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "ts_int8_bf16_rows": [_i64],
    "ts_int8_rows16": [],
    "ts_int8_linear_packed16": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "ts_int4_packed16_span": [_i64, _i64],
    "ts_int4_linear_packed16": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    "ts_int8_dequantize": [_ptr, _ptr, _ptr, _i64, _i64, _int],
    "ts_flash_prefill_supported": [_int],
    "ts_paged_bf16_tiles": [_int],
    "ts_paged_decode_rows": [_int, _int],
    "ts_int4_supported": [],
    "ts_int4_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    "ts_int4_dequantize": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "ts_w8a8_supported": [],
    "ts_w8a8_block_channels": [],
    "ts_w8a8_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "ts_bf16_linear_supported": [],
    "ts_bf16_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "ts_flash_prefill": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _int, _int, _int, _float,
                         _ptr, _i64],
}
RETURNS = dict.fromkeys([
    "ts_paged_attention", "ts_paged_bf16_tiles", "ts_paged_decode_rows", "ts_flash_prefill_supported",
    "ts_flash_prefill", "ts_int8_linear", "ts_int8_bf16_rows", "ts_int8_rows16", "ts_int8_linear_packed16",
    "ts_int4_supported", "ts_int4_linear", "ts_int4_linear_packed16", "ts_w8a8_supported",
    "ts_w8a8_block_channels", "ts_w8a8_linear", "ts_bf16_linear_supported", "ts_bf16_linear"],
    ctypes.c_int) | {"ts_int4_packed16_span": ctypes.c_int64}


def _cpu_tag() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [path.read_text() for path in sorted(CSRC.glob("*.[ch]"))]  # the headers too
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS[:-1] + LIBS), version, _cpu_tag()]).encode())
    return cache_dir() / "kernels" / key.hexdigest()[:20] / "libtreeserve_cpu.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), *LIBS, "-o", partial], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)  # atomic: concurrent builders each install a whole library
    finally:
        Path(partial).unlink(missing_ok=True)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (with the reason logged) where it cannot be had."""
    if os.environ.get("TREESERVE_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels off (TREESERVE_CPU_KERNELS=0): PyTorch paths only")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler (cc, or $CC): treeserve's CPU kernels are off, PyTorch paths only")
        return None
    try:
        target = _library_path(compiler)
        if not target.is_file():
            logger.info("building treeserve's CPU kernels into %s", target)
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("treeserve's CPU kernels are off (%s): PyTorch paths only", exc)
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = RETURNS.get(name)
    return library


def library_for(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library where it serves this tensor (on the CPU, float32 or bfloat16, outside autograd:
    the kernels write through raw pointers), else None."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.requires_grad:
        return None
    return load()


def supports(dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the paged kernels can run this attention (then `load()` decides whether they are built)."""
    return (device.type == "cpu" and dtype in DTYPES and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM)


def paged_attention(library: ctypes.CDLL, q: torch.Tensor, layer_cache: torch.Tensor, block_ids: torch.Tensor,
                    block_starts: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None,
                    out: torch.Tensor, softcap: float | None = None) -> None:
    """One query token per row (a decode, or one prefill token with its causal length): q
    [rows, Hq, D] (heads contiguous) over `layer_cache` [num_blocks, 2, block_size, Hkv, D] into
    `out` (contiguous, like q). Row i's blocks are `block_ids[block_starts[i]:]` (int64), its keys
    the first `context_lens[i]` (int64). `softcap`: scores become softcap * tanh(score / softcap)."""
    rows, num_heads, head_dim = q.shape
    strides = layer_cache.stride()
    if q.stride(2) != 1 or q.stride(1) != head_dim or strides[4] != 1 or not out.is_contiguous():
        raise ValueError("paged_attention: q's heads, the cache's head_dim and out must be contiguous")
    status = library.ts_paged_attention(
        q.data_ptr(), q.stride(0), layer_cache.data_ptr(), strides[0], strides[1], strides[2], strides[3],
        layer_cache.shape[2], block_ids.data_ptr(), block_starts.data_ptr(), context_lens.data_ptr(), rows,
        num_heads, layer_cache.shape[3], head_dim, scale, window or 0, softcap or 0.0, DTYPES[q.dtype], out.data_ptr())
    if status == -2:
        raise MemoryError("paged_attention: no memory for the kernel's per-thread state")
    if status != 0:
        raise ValueError(f"paged_attention: shape beyond the kernel's limits (heads {num_heads}/"
                         f"{layer_cache.shape[3]}, head_dim {head_dim})")


def _rows(x: torch.Tensor) -> int:
    """Elements between the rows of x seen as [rows, x.shape[-1]] (its last dim contiguous)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("expected rows with a contiguous last dimension")
    return x.stride(0)


def rms_norm(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x's rows ([rows, size]); with `residual` (contiguous, updated in place to
    x + residual), of their sum. The weight has x's dtype."""
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm: residual must be contiguous")
    library.ts_rms_norm(x.data_ptr(), _rows(x), None if residual is None else residual.data_ptr(),
                        weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, DTYPES[x.dtype])
    return out


def silu_mul(library: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows holding the gates then the ups: [rows, 2 * size] -> [rows, size]."""
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    library.ts_silu_mul(gate_up.data_ptr(), _rows(gate_up), out.data_ptr(), rows, width // 2, DTYPES[gate_up.dtype])
    return out


def rotary_(library: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate-half rotary embedding in place on q [T, Hq, D] and k [T, Hkv, D] (heads contiguous),
    from float32 tables [max_positions, D]; positions int64. One pass where k's heads follow q's
    in each row (both views of the qkv projection), else one per tensor."""
    if not (heads_contiguous(q) and heads_contiguous(k) and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary_: q's and k's heads and the tables must be contiguous")
    positions = positions.contiguous()
    head_bytes = q.shape[2] * q.element_size()
    if q.stride(0) == k.stride(0) and k.data_ptr() == q.data_ptr() + q.shape[1] * head_bytes:
        parts = [(q, q.shape[1] + k.shape[1])]
    else:
        parts = [(q, q.shape[1]), (k, k.shape[1])]
    for x, heads in parts:
        library.ts_rotary(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0],
                          heads, x.shape[2], DTYPES[x.dtype])


def write_kv(library: ctypes.CDLL, layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (heads contiguous) into `layer_cache` [num_blocks, 2, block_size, Hkv, D]
    at `slots` (int64, contiguous): block slot // block_size, offset slot % block_size."""
    if not can_write_kv(layer_cache, k, v, slots):
        raise ValueError("write_kv: k, v and the cache need contiguous heads, slots contiguous int64")
    strides = layer_cache.stride()
    library.ts_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), layer_cache.data_ptr(), strides[0],
                        strides[1], strides[2], layer_cache.shape[2], slots.data_ptr(), k.shape[0],
                        k.shape[1] * k.shape[2], DTYPES[k.dtype])


def can_write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    strides = layer_cache.stride()
    return (heads_contiguous(k) and heads_contiguous(v) and strides[3] == k.shape[2] and strides[4] == 1
            and slots.is_contiguous() and slots.dtype == torch.long and k.dtype == v.dtype == layer_cache.dtype
            and layer_cache.device.type == "cpu")


def heads_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, head_dim] with each row's heads one contiguous run."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


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


def int8_pack16(weight: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] (K a multiple of 32) in csrc/int8_linear.c's packed layout: int8
    [ceil(N / 64) * 64 * K], blocks of 64 channels, in each the pairs of inputs' two bytes side by
    side for every channel (zero channels past N)."""
    if weight.shape[1] % 32:
        raise ValueError(f"int8_pack16: {weight.shape[1]} inputs, not a multiple of 32")
    return _interleave_channels(weight, INT8_PACK16_BLOCK, torch.int16)


def _interleave_channels(weight: torch.Tensor, block: int, word: torch.dtype) -> torch.Tensor:
    """int8 [N, K] in blocks of `block` channels, in each the channels' next `word`-sized run of
    inputs side by side: int8 [ceil(N / block) * block * K], zero channels past N. The runs move as
    one element each (a quarter or half of the bytes' count); a few MiB of blocks at a time, so that
    packing needs no more than the packed result beside the weight (an LM head is 0.5 GB)."""
    n, k = weight.shape
    blocks = -(-n // block)
    runs = weight.contiguous().view(word)  # [N, runs]
    out = torch.empty(blocks, runs.shape[1], block, dtype=word)
    step = max(1, PACK_CHUNK_BYTES // (block * k))
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        rows = runs[b0 * block:b1 * block]
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


def int8_unpack16(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """An `int8_pack16`ed weight back as int8 [n, k]."""
    pairs = packed.view(torch.int16).reshape(-1, k // 2, INT8_PACK16_BLOCK)
    return pairs.transpose(1, 2).contiguous().view(torch.int8).reshape(-1, k)[:n]


BF16_PACK_BLOCK = 64  # channels per block of csrc/bf16_linear.c's layout


def bf16_linear_supported(library: ctypes.CDLL | None) -> bool:
    """Whether `bf16_linear` runs here (the library built, the CPU with AVX512-BF16)."""
    return library is not None and library.ts_bf16_linear_supported() == 1


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 weights [N, K] (K even) in csrc/bf16_linear.c's layout: bfloat16
    [ceil(N / 64) * 64 * K], blocks of 64 channels, in each every channel's next pair of inputs
    side by side (zero channels past N)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"bf16_pack: expected bfloat16 [N, K] with K even, got {weight.dtype} {tuple(weight.shape)}")
    return _interleave_channels(weight.contiguous().view(torch.int8), BF16_PACK_BLOCK, torch.int32).view(torch.bfloat16)


def bf16_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A `bf16_pack`ed weight back as bfloat16 [n, k]."""
    pairs = packed.view(torch.int32).reshape(-1, k // 2, BF16_PACK_BLOCK)
    return pairs.transpose(1, 2).contiguous().view(torch.bfloat16).reshape(-1, k)[:n]


def bf16_linear(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [rows, K] bfloat16 (last dim contiguous) times the `bf16_pack`ed weight (+ bias, bfloat16
    [N] contiguous): [rows, N] bfloat16, summed in float32 and rounded once."""
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    status = library.ts_bf16_linear(x.data_ptr(), _rows(x), packed.data_ptr(),
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                    out_features, x.shape[1])
    if status == -2:
        raise MemoryError("bf16_linear: no memory for the partial sums")
    if status != 0:
        raise ValueError(f"bf16_linear: cannot run {x.shape[1]} inputs on this CPU")
    return out


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


def int4_pack16(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [N, K] (0..15; K a multiple of 32) in csrc/int4_linear.c's packed layout: uint8
    [ceil(N / 64) * 64 * K / 2], blocks of 64 channels, in each for every four inputs k .. k + 3
    each channel's bytes q[k] | q[k + 2] << 4 and q[k + 1] | q[k + 3] << 4 (zero channels past N)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4_pack16: {k} inputs, not a multiple of 32")
    blocks = -(-n // INT4_PACK16_BLOCK)
    padded = torch.zeros(blocks * INT4_PACK16_BLOCK, k, dtype=torch.uint8)
    padded[:n] = q
    quads = padded.reshape(blocks, INT4_PACK16_BLOCK, k // 4, 4)
    pairs = quads[..., :2] | (quads[..., 2:] << 4)  # [blocks, 64, K / 4, 2]
    return pairs.permute(0, 2, 1, 3).contiguous().reshape(-1)


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


def flash_prefill(library: ctypes.CDLL, q: torch.Tensor, layer_cache: torch.Tensor, block_ids: torch.Tensor,
                  context_len: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """A prefill chunk's causal attention in bfloat16 over all its sequence's keys in the cache
    (csrc/flash_prefill.c): q [Q, Hq, D] (heads contiguous) at positions context_len - Q ... context_len
    - 1, the chunk's keys and values already written; block_ids int64 (contiguous). Into `out` (heads
    contiguous; a new tensor if None), returned; None where the kernel cannot run it (no
    AVX512-BF16, head size, group), and then `out` is untouched."""
    query_len, num_heads, head_dim = q.shape
    strides = layer_cache.stride()
    if (q.dtype != torch.bfloat16 or layer_cache.dtype != torch.bfloat16 or not heads_contiguous(q)
            or strides[4] != 1 or not block_ids.is_contiguous() or block_ids.dtype != torch.long
            or (out is not None and not heads_contiguous(out))
            or library.ts_flash_prefill_supported(head_dim) != 1):
        return None
    out = torch.empty((query_len, num_heads, head_dim), dtype=q.dtype) if out is None else out
    status = library.ts_flash_prefill(
        q.data_ptr(), q.stride(0), layer_cache.data_ptr(), strides[0], strides[1], strides[2], strides[3],
        layer_cache.shape[2], block_ids.data_ptr(), context_len, query_len, num_heads, layer_cache.shape[3], head_dim,
        scale, out.data_ptr(), out.stride(0))
    if status == -2:
        raise MemoryError("flash_prefill: no memory for the packed keys and values")
    return out if status == 0 else None
