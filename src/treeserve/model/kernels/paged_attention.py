"""Paged attention in Triton over one step's flat batch of query tokens.

`unified_attention` serves any mix of decode rows and prefill chunks in one launch. Sequence i owns
query rows `query_start_loc[i]:query_start_loc[i + 1]`, the last rows of its first `seq_lens[i]`
tokens, whose keys and values sit in the paged cache at the blocks `block_tables[i]`. The grid is
(query blocks, KV heads): a program takes `BLOCK_Q` consecutive query positions of one sequence
and all the query heads of one KV group, so each tile of keys and values is loaded once for the
group (GQA). A program finds its sequence by a binary search over the query start offsets. A query
at absolute position p sees keys k with k <= p (and k > p - window with a sliding window), which
covers chunked prefill over a cached prefix. With a soft cap c (Gemma 2), a score s becomes
c * tanh(s / c) before the softmax. KV tiles of `TILE_N` keys are independent of the
cache's block size: each key's block id is read from the table. Head sizes that are not powers of
two (80, 96) are padded to one inside the kernel and masked.

`split_kv_decode` is the variant for few long sequences, one query token each: the keys of each
sequence are cut into `num_splits` ranges computed in parallel, then a second kernel merges the
partial results by their log-sum-exp. Its partial buffers come from the caller, so a CUDA graph
can capture it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_N = 32
DECODE_TILE_N = 64  # keys per tile in the split-KV decode kernel (benchmarks/gpu_attention.py, docs/BENCHMARKS.md)
BLOCK_M = 16  # query rows of one program (positions x query heads of a group), at least 16 for tl.dot


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query block, query_start_loc[i] // BLOCK_Q + i, is <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), tanh written with exp (1 - 2 / (e^2x + 1): exact at both ends)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, key_lo, key_hi, query_abs,
                  scale, window, softcap, kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  offs_d, dim_ok, CACHE_BLOCK: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over keys [key_lo, key_hi) of one sequence, for rows at `query_abs`."""
    for tile_start in range(key_lo, key_hi, TILE):
        keys = tile_start + tl.arange(0, TILE)
        key_ok = keys < key_hi
        blocks = tl.load(table_ptr + keys // CACHE_BLOCK, mask=key_ok, other=0).to(tl.int64)
        offsets = (keys % CACHE_BLOCK).to(tl.int64)
        k_ptrs = k_cache_ptr + blocks[None, :] * stride_kb + offsets[None, :] * stride_kt + kv_head * stride_kh \
            + offs_d[:, None]
        k = tl.load(k_ptrs, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        v_ptrs = v_cache_ptr + blocks[:, None] * stride_vb + offsets[:, None] * stride_vt + kv_head * stride_vh \
            + offs_d[None, :]
        v = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        visible = key_ok[None, :] & (keys[None, :] <= query_abs[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > query_abs[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, window, softcap, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    QUERIES_PER_KV: tl.constexpr, CACHE_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q < query_len:
        context_len = tl.load(seq_lens_ptr + seq) - query_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_P)
        dim_ok = offs_d < HEAD_DIM
        query_pos = local_block * BLOCK_Q + offs_m // QUERIES_PER_KV
        head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
        row_ok = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (query_pos < query_len)
        token = (q_start + query_pos).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        key_hi = context_len + tl.minimum((local_block + 1) * BLOCK_Q, query_len)
        key_lo = 0
        if HAS_WINDOW:
            key_lo = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
            key_lo, key_hi, context_len + query_pos, scale, window, softcap, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d, dim_ok,
            CACHE_BLOCK, TILE, HAS_WINDOW, SOFTCAP, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, block_tables_ptr, seq_lens_ptr,
    scale, window, softcap,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, NUM_SPLITS: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    dim_ok = offs_d < HEAD_DIM
    head = kv_head * QUERIES_PER_KV + offs_m
    row_ok = offs_m < QUERIES_PER_KV
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), TILE) * TILE
    key_lo = first_key + split * per_split
    key_hi = tl.minimum(key_lo + per_split, seq_len)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    query_abs = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        key_lo, key_hi, query_abs, scale, window, softcap, kv_head,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d, dim_ok,
        CACHE_BLOCK, TILE, HAS_WINDOW, SOFTCAP, IEEE)
    # partial buffers: [num_seqs, NUM_HEADS, NUM_SPLITS(, HEAD_DIM_P)], contiguous
    row = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split
    tl.store(part_max_ptr + row, m_i, mask=row_ok)
    tl.store(part_sum_ptr + row, l_i, mask=row_ok)
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    maxes = tl.load(part_max_ptr + first + splits)
    sums = tl.load(part_sum_ptr + first + splits)
    accs = tl.load(part_acc_ptr + (first + splits)[:, None] * HEAD_DIM_P + offs_d[None, :])
    top = tl.max(maxes, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key at all (a padded row)
    weights = tl.exp(maxes - top)
    total = tl.sum(weights * sums, 0)
    out = tl.sum(weights[:, None] * accs, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _head_dim_padded(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, token, head) strides of a [num_blocks, block_size, kv_heads, head_dim] cache view."""
    if cache.stride(3) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    return cache.stride(0), cache.stride(1), cache.stride(2)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, window: int | None, num_tokens: int | None = None,
                      softcap: float | None = None) -> None:
    """Attention for every query row of the flat batch, written into `out` ([T, Hq, D] like q).

    `num_tokens` bounds the grid (defaults to q's rows); a CUDA graph passes its padded batch size."""
    num_tokens = q.shape[0] if num_tokens is None else num_tokens
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(per_kv))
    block_q = block_m // per_kv
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale, window or 0, softcap or 0.0, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(k_cache), *_cache_strides(v_cache), block_tables.stride(0),
        QUERIES_PER_KV=per_kv, CACHE_BLOCK=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_DIM_P=_head_dim_padded(head_dim), BLOCK_Q=block_q, BLOCK_M=block_m, TILE=TILE_N,
        HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32,
    )


def _decode_tile(q: torch.Tensor, padded_head_dim: int) -> int:
    """DECODE_TILE_N keys per tile where it was measured (16-bit K/V, heads up to 128); else the
    unified kernel's tile: a 128-key float32 tile of wide heads may not fit a smaller GPU's shared memory."""
    return DECODE_TILE_N if q.element_size() == 2 and padded_head_dim <= 128 else TILE_N


def split_kv_buffers(num_seqs: int, num_heads: int, head_dim: int, num_splits: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partial outputs, partial maxima, partial sums) for `split_kv_decode`."""
    rows = (num_seqs, num_heads, num_splits)
    return (torch.empty(*rows, _head_dim_padded(head_dim), dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, window: int | None,
                    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor], softcap: float | None = None) -> None:
    """One query token per sequence (row i is sequence i), keys split into the buffers' number of
    ranges (a power of two) and merged."""
    part_acc, part_max, part_sum = buffers
    num_seqs, (num_heads, head_dim) = seq_lens.shape[0], q.shape[1:]
    num_splits = part_max.shape[2]
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    padded = _head_dim_padded(head_dim)
    _split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_acc, part_max, part_sum, block_tables, seq_lens,
        scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), *_cache_strides(k_cache), *_cache_strides(v_cache), block_tables.stride(0),
        NUM_HEADS=num_heads, QUERIES_PER_KV=per_kv, NUM_SPLITS=num_splits, CACHE_BLOCK=k_cache.shape[1],
        HEAD_DIM=head_dim, HEAD_DIM_P=padded, BLOCK_M=max(BLOCK_M, triton.next_power_of_2(per_kv)),
        TILE=_decode_tile(q, padded),
        HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P=padded,
    )
