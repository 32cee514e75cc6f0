"""Mixture-of-experts products in Triton, for the GPU path: every expert's tokens in one launch.

The (token, expert) pairs of a batch are sorted by expert and each expert's run padded to a whole
number of BLOCK_M rows (`align_pairs`), so a program's block of rows belongs to one expert. The
grouped kernel multiplies each block by its expert's weight ([E, N, K], rows `weight[e] @ a`):
once over the tokens' hidden states with the stacked gate/up weights (pair p reads token
p // top_k), once over the pairs' SwiGLU outputs with the down weights, each row times its pair's
routing weight. Products accumulate in float32 and are rounded once into the output's dtype;
summing a token's top_k rows finishes the layer. No loop over experts on the host and no copy of
the tokens into per-expert batches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """For `expert_ids` [T, k]: (pair ids sorted by expert, each expert's run padded to a multiple
    of `block_m` with the sentinel T * k; the expert of each block of `block_m` rows)."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    starts = torch.cumsum(padded, 0) - padded
    sorted_ids = torch.full((total,), flat.numel(), dtype=torch.int32, device=flat.device)
    run_start = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in `order`
    rank = torch.arange(flat.numel(), device=flat.device) - run_start[flat[order]]
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_ids, block_experts.to(torch.int32)


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, pair_weights_ptr,
    num_pairs, N, K, stride_a, stride_we, stride_wn, stride_o,
    TOP_K: tl.constexpr, ROWS_BY_TOKEN: tl.constexpr, WEIGHTED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // TOP_K if ROWS_BY_TOKEN else pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_a + k[None, :],
                    mask=valid[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if WEIGHTED:
        acc *= tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_o + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def grouped_matmul(a: torch.Tensor, weight: torch.Tensor, sorted_ids: torch.Tensor, block_experts: torch.Tensor,
                   num_pairs: int, top_k: int, rows_by_token: bool,
                   pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """[num_pairs, N]: row p = weight[expert of p] @ a[p // top_k if rows_by_token else p] (times
    pair_weights[p] if given); `weight` [E, N, K], rows of `a` contiguous."""
    num_experts, n, k = weight.shape
    if weight.stride(2) != 1 or a.stride(-1) != 1:
        raise ValueError("grouped_matmul: the last dimensions of `a` and `weight` must be contiguous")
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (sorted_ids.shape[0] // BLOCK_M, triton.cdiv(n, BLOCK_N))
    _grouped_matmul_kernel[grid](
        a, weight, out, sorted_ids, block_experts, pair_weights if pair_weights is not None else out,
        num_pairs, n, k, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        TOP_K=top_k, ROWS_BY_TOKEN=rows_by_token, WEIGHTED=pair_weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                    weights: torch.Tensor, silu_mul) -> torch.Tensor:
    """x [T, H] through the stacked experts (`gate_up` [E, 2I, H], `down` [E, H, I]) its tokens chose
    (`expert_ids`, `weights` [T, k]): the weighted sum over each token's k experts, [T, H].
    `silu_mul([P, 2I]) -> [P, I]`: SiLU(gate) * up."""
    tokens, top_k = expert_ids.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    sorted_ids, block_experts = align_pairs(expert_ids, gate_up.shape[0])
    h = grouped_matmul(x, gate_up, sorted_ids, block_experts, num_pairs, top_k, rows_by_token=True)
    y = grouped_matmul(silu_mul(h), down, sorted_ids, block_experts, num_pairs, top_k, rows_by_token=False,
                       pair_weights=weights.reshape(-1).contiguous())
    return y.view(tokens, top_k, -1).sum(dim=1)
