"""The step's new keys and values written into the paged cache by slot, in Triton.

Slot s is token s % block_size of block s // block_size; a negative slot writes nothing (the padded
rows of a CUDA graph's batch)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr,
                     HEAD_DIM_P: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // CACHE_BLOCK
        offset = slot % CACHE_BLOCK
        heads = tl.arange(0, HEADS_P)[:, None]
        dims = tl.arange(0, HEAD_DIM_P)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims, k, mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] views; slot_mapping: [T]."""
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("keys, values and the cache need a contiguous head dimension")
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim), CACHE_BLOCK=k_cache.shape[1],
    )
