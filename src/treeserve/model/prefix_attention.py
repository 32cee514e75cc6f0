"""A prefill chunk's attention on CPU when its sequence already has cached tokens: the chunk's own
keys (causal) and the cached prefix (every key visible), attended separately and merged by their
log-sum-exps, with the prefix read in segments of at most `PREFIX_SEGMENT_TOKENS`.

Against one SDPA call over the gathered prefix + chunk with a boolean [Q, L] mask, this:
- lets PyTorch's CPU flash kernel run unmasked tiles (a mask makes it read and apply the mask on
  every tile, and skip none);
- attends the prefix with the query heads that share a KV head stacked along the query axis
  (grouped-query attention without repeating keys);
- bounds the workspace: one segment's gathered keys and values, and no [Q, L] mask, whatever the
  prompt's length (a 32k-token prompt gathered whole costs 2 x 32k x Hkv x D per layer).

The merge is exact: softmax over the union of two key sets is the two partial outputs weighted by
exp(lse_part - lse_total).
"""
from __future__ import annotations

from typing import Callable

import torch

# Keys gathered from the cache at a time for one chunk's prefix attention: 4,096 tokens x 4 KV
# heads x 64 x float32 is 4 MiB for the keys, as much for the values.
PREFIX_SEGMENT_TOKENS = 4096

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# (start, end) token positions of the cached prefix -> keys, values [Hkv, end - start, D]
GatherPrefix = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def supported(q: torch.Tensor, window: int | None, softcap: float | None) -> bool:
    """Whether `chunk_over_prefix` runs this layer: on CPU in float32 or bfloat16 (the dtypes it is
    tested in), without a sliding window or soft-capped scores (the masked path keeps those)."""
    return q.device.type == "cpu" and window is None and softcap is None and q.dtype in (torch.float32, torch.bfloat16)


def chunk_over_prefix(query: torch.Tensor, chunk_keys: torch.Tensor, chunk_values: torch.Tensor, prefix_len: int,
                      gather: GatherPrefix, scale: float, segment: int | None = None) -> torch.Tensor:
    """query [Q, Hq, D] and the chunk's keys and values [Q, Hkv, D], the chunk following `prefix_len`
    cached tokens read through `gather` (`segment` tokens at a time, default `PREFIX_SEGMENT_TOKENS`);
    returns [Q, Hq, D]."""
    segment = segment or PREFIX_SEGMENT_TOKENS
    query_len, num_heads, head_dim = query.shape
    num_kv_heads = chunk_keys.shape[1]
    heads_first = query.transpose(0, 1)  # [Hq, Q, D]
    out, lse = _chunk_causal(heads_first, chunk_keys, chunk_values, num_heads // num_kv_heads, scale)
    # from here on in the prefix's grouping: [1, Hkv, group * Q, D], query head h * group + j at row j * Q + t
    grouped = heads_first.reshape(1, num_kv_heads, -1, head_dim)
    out, lse = out.reshape(grouped.shape), lse.reshape(grouped.shape[:3])
    for start in range(0, prefix_len, segment):
        keys, values = gather(start, min(start + segment, prefix_len))
        part, part_lse = _flash(grouped, keys.unsqueeze(0), values.unsqueeze(0), scale=scale)
        out, lse = merge(out, lse, part, part_lse)
    return out.reshape(num_heads, query_len, head_dim).transpose(0, 1).to(query.dtype)


def _chunk_causal(heads_first: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's causal attention over its own keys: ([1, Hq, Q, D], lse [1, Hq, Q])."""
    def per_query_head(x: torch.Tensor) -> torch.Tensor:  # [Q, Hkv, D] -> [1, Hq, Q, D]
        x = x.transpose(0, 1)
        return (x.repeat_interleave(group, 0) if group > 1 else x).unsqueeze(0)
    return _flash(heads_first.unsqueeze(0), per_query_head(keys), per_query_head(values), is_causal=True, scale=scale)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint key sets ([..., L, D] outputs and their
    [..., L] log-sum-exps, float32) -> the attention over both, and its log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a.float() * weight_a + out_b.float() * weight_b, lse
