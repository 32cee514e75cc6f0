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
    "ts_int4_wide_rows": [],
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
    "ts_bf16_linear_silu_mul": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "ts_bf16_linear_rotary": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "ts_flash_prefill": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _int, _int, _int, _float,
                         _ptr, _i64],
}
RETURNS = dict.fromkeys([
    "ts_paged_attention", "ts_paged_bf16_tiles", "ts_paged_decode_rows", "ts_flash_prefill_supported",
    "ts_flash_prefill", "ts_int8_linear", "ts_int8_bf16_rows", "ts_int8_rows16", "ts_int8_linear_packed16",
    "ts_int4_supported", "ts_int4_linear", "ts_int4_linear_packed16", "ts_w8a8_supported",
    "ts_w8a8_block_channels", "ts_w8a8_linear", "ts_bf16_linear_supported", "ts_bf16_linear",
    "ts_bf16_linear_silu_mul", "ts_bf16_linear_rotary"],
    ctypes.c_int) | {"ts_int4_packed16_span": ctypes.c_int64, "ts_int4_wide_rows": ctypes.c_int64}


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
