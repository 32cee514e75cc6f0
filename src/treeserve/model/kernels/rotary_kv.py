"""Rotary embedding and the K/V write by slot in one Triton launch: q rotated in place, k rotated
straight into the paged cache, v copied beside it.

Apart, a layer of the GPU path launches `fused_ops.rotary_` (q and k in place) and then
`kv_write.write_kv` (k and v into the cache); a batch-1 decode step is device-bound, so one launch
fewer a layer is ~16 fewer of a step's ~160. The rotation is `fused_ops`' own (the same helper,
the same roundings), so q and the cache hold the bytes the pair leaves. The k tensor itself is left
as it came: the attention kernels read keys from the cache only. A negative slot (a CUDA graph's
padded rows) writes nothing to the cache; its q is still rotated (its attention, over no keys, is
zeros either way).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.model.kernels.fused_ops import _angles, _rotate_heads


@triton.jit
def _rotary_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, positions_ptr, cos_ptr,
                      sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_table,
                      NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                      Q_HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr, HALF_P: tl.constexpr,
                      HEAD_DIM_P: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _angles(positions_ptr, token, cos_ptr, sin_ptr, stride_table, q_ptr.dtype.element_ty, HALF, HALF_P)
    q = q_ptr + token * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, NUM_Q_HEADS, HALF, Q_HEADS_P, HALF_P)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // CACHE_BLOCK
        offset = slot % CACHE_BLOCK
        k_row = k_cache_ptr + block * stride_kcb + offset * stride_kct
        _rotate_heads(k_ptr + token * stride_kt, stride_kh, k_row, stride_kch, cos, sin, NUM_KV_HEADS, HALF,
                      KV_HEADS_P, HALF_P)
        heads = tl.arange(0, KV_HEADS_P)[:, None]
        dims = tl.arange(0, HEAD_DIM_P)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims, v, mask=mask)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q: [T, Hq, D] (rotated in place); k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
    views; slot_mapping, positions: [T]; cos/sin: [rows, D] float32 tables (rotate-half)."""
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("queries, keys, values and the cache need a contiguous head dimension")
    num_heads, (num_kv_heads, head_dim) = q.shape[1], k.shape[1:]
    _rotary_kv_kernel[(q.shape[0],)](
        q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cos.stride(0), NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        Q_HEADS_P=triton.next_power_of_2(num_heads), KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HALF_P=triton.next_power_of_2(head_dim // 2), HEAD_DIM_P=triton.next_power_of_2(head_dim),
        CACHE_BLOCK=k_cache.shape[1],
    )
