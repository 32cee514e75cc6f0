"""Paged attention over a flat, unpadded token batch.

The runner orders each step's tokens as decode groups first (one query token per request,
requests of similar context length grouped together to bound padding), then prefill chunks.
`TorchSDPABackend` writes the step's keys/values into the paged cache by slot, then runs
`scaled_dot_product_attention` on batched block gathers; it is device-agnostic (CPU and CUDA).
One-token decode on CPU in bfloat16 or float16 uses `decode_by_matmul` instead of SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.nn import functional as F


@dataclass
class DecodeGroup:
    rows: slice                 # positions of this group's query tokens in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] keys visible to each query (includes the query itself)


@dataclass
class PrefillChunk:
    rows: slice
    context_len: int            # tokens in the sequence after this chunk
    query_len: int
    block_ids: torch.Tensor     # [ceil(context_len / block_size)] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each token
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    @cached_property
    def slot_blocks(self) -> torch.Tensor:
        return torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")

    @cached_property
    def slot_offsets(self) -> torch.Tensor:
        return self.slot_mapping % self.block_size

    def decode_mask(self, index: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """An additive mask (0 or -inf) over the group's gathered keys: SDPA on CPU would convert a
        boolean one on every layer."""
        key = ("decode", index, window, dtype)
        if key not in self._masks:
            group = self.decode_groups[index]
            width = group.block_tables.shape[1] * self.block_size
            keys = torch.arange(width, device=group.context_lens.device)[None, :]
            lens = group.context_lens[:, None]
            mask = keys < lens
            if window is not None:
                mask &= keys >= lens - window
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._masks[key] = additive[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """None means plain causal attention over the chunk's own keys."""
        chunk = self.prefills[index]
        if chunk.context_len == chunk.query_len and window is None:
            return None
        key = ("prefill", index, window)
        if key not in self._masks:
            device = chunk.block_ids.device
            first = chunk.context_len - chunk.query_len
            query_pos = torch.arange(first, chunk.context_len, device=device)[:, None]
            key_pos = torch.arange(chunk.context_len, device=device)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            self._masks[key] = mask
        return self._masks[key]


class TorchSDPABackend:
    """Attention with PyTorch's SDPA kernels over gathered cache blocks."""

    name = "torch_sdpa"

    def forward(
        self,
        layer_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D] (a view into the KV pages)
        q: torch.Tensor,            # [T, Hq, D]
        k: torch.Tensor,            # [T, Hkv, D]
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        self._write_cache(layer_cache, k, v, meta)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for index, group in enumerate(meta.decode_groups):
            out[group.rows] = self._decode(layer_cache, q[group.rows], group, meta.decode_mask(index, window, q.dtype),
                                           scale, gqa)
        for index, chunk in enumerate(meta.prefills):
            mask = meta.prefill_mask(index, window)
            out[chunk.rows] = self._prefill(layer_cache, q, k, v, chunk, mask, scale, gqa)
        return out

    @staticmethod
    def _write_cache(layer_cache, k, v, meta: AttentionMetadata):
        slots = (meta.slot_blocks, meta.slot_offsets)
        layer_cache[:, 0].index_put_(slots, k)
        layer_cache[:, 1].index_put_(slots, v)

    @staticmethod
    def _gather(cache_part: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[..., nb] block ids -> [..., Hkv, nb * block_size, D] keys or values.

        `index_select` on a [num_blocks, block_elements] view (blocks may be strided: they live in
        pages) is several times faster on CPU than advanced indexing of the 4-d cache.
        """
        num_blocks, block_size, num_kv_heads, head_dim = cache_part.shape
        rows = cache_part.view(num_blocks, -1).index_select(0, block_ids.reshape(-1))
        flat = rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)
        return flat.transpose(-3, -2)

    def _decode(self, layer_cache, q, group, mask, scale, gqa):
        keys = self._gather(layer_cache[:, 0], group.block_tables)
        values = self._gather(layer_cache[:, 1], group.block_tables)
        if q.device.type == "cpu" and q.dtype != torch.float32:
            return decode_by_matmul(q, keys, values, mask, scale)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        return out.squeeze(2)

    def _prefill(self, layer_cache, q, k, v, chunk, mask, scale, gqa):
        query = q[chunk.rows].transpose(0, 1).unsqueeze(0)
        if chunk.context_len == chunk.query_len:
            keys = k[chunk.rows].transpose(0, 1).unsqueeze(0)
            values = v[chunk.rows].transpose(0, 1).unsqueeze(0)
        else:
            keys = self._gather(layer_cache[:, 0], chunk.block_ids)[:, : chunk.context_len].unsqueeze(0)
            values = self._gather(layer_cache[:, 1], chunk.block_ids)[:, : chunk.context_len].unsqueeze(0)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        return out.squeeze(0).transpose(0, 1)


def decode_by_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query token per sequence: [B, Hq, D] queries over [B, Hkv, L, D] keys and values with an
    additive [B, 1, 1, L] mask. Query heads sharing a KV head are one matrix product, so keys are
    never repeated; softmax runs in float32 (as HF's eager attention does).

    On CPU in bfloat16, PyTorch's SDPA kernel is two to four times slower than this for one query
    token (`benchmarks/decode_attention.py --dtype bfloat16`); in float32 SDPA is the faster.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    # scaled before the product, so that float16 dot products cannot overflow
    grouped = (q * scale).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() + mask
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)
