"""Paged attention over a flat, unpadded token batch.

The runner orders each step's tokens as decode rows first (one query token per request, sorted by
context length), then prefill chunks, those of short sequences first. `TorchSDPABackend` writes
the step's keys/values into the paged cache by slot, then attends:
- on CPU in float32 or bfloat16, the `PagedRows` (the decode rows and, where that is faster, the
  rows of prefill chunks whose sequence is at most `PAGED_PREFILL_MAX_CONTEXT` tokens long, every
  row with its own causal length): treeserve's C kernel (`cpu_kernels.paged_attention`) reads the
  paged cache in place, no gather, no padding, no mask: tiles of 16 keys into an online softmax,
  and decode rows over a bfloat16 cache on CPUs with AVX512-BF16 in two passes per 512 keys
  (`csrc/paged_decode.c`: all scores, then the values);
- otherwise (CUDA, float16, no C compiler) decode rows are grouped by context length (which bounds
  the padding), each group's blocks gathered for `scaled_dot_product_attention`, or
  `decode_by_matmul` for one-token decode on CPU in bfloat16 or float16;
- the other prefill chunks: SDPA over the chunk's own keys, causal; a chunk that follows cached
  tokens (a later chunk of a long prompt, a prefix-cache hit) on CPU, without a window or soft cap,
  through `prefix_attention.chunk_over_prefix` (its own keys and the prefix apart, the prefix in
  bounded segments, merged by log-sum-exp), elsewhere SDPA over the gathered keys with a mask.
A layer with soft-capped scores (Gemma 2: softcap * tanh(score / softcap)) has them capped in the C
kernel, and takes `decode_by_matmul` / `prefill_by_matmul` where SDPA would run (SDPA cannot cap).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.nn import functional as F

from treeserve.model import cpu_kernels, prefix_attention

# Decode rows are grouped by context length so that one group's padding stays small.
DECODE_GROUP_GROWTH = 1.5
# Prefill chunks of sequences up to this long go through the C kernel with the decode rows, in
# bfloat16 with grouped-query attention (3+ query heads per KV head); past it, in float32, or with
# fewer query heads per KV head, PyTorch's flash SDPA is the faster. One causal prefill, two
# threads (Zen 4), kernel / SDPA time since the kernel reads each tile of keys once for 16
# consecutive query rows: bf16 12q/4kv heads of 64: 0.55, 0.72, 0.78, 1.22 at 64, 200, 384, 1024
# tokens; bf16 4/4 heads of 32: 0.93, 0.77, 1.22, 1.95; float32 4/4 heads of 32: 0.90-2.13
# (float32 12/4 heads of 64: 0.67-0.86 up to 384, not used: unmeasured on AVX2-only CPUs). The
# bundled search models (float32, 4/4 heads of 32) ran memory_split's workload 9-16% slower with
# their prefills in the kernel than with none of the kernels (5.9 against 7.0 problems/s shared).
PAGED_PREFILL_MAX_CONTEXT = 512


def paged_prefill_max_context(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int = 0) -> int:
    """The longest sequence whose prefill rows join the paged rows (0: none do). None in bfloat16
    where the bf16 prefill kernel runs (AVX512-BF16): it is faster at every length (the mixed
    workload of benchmarks/peers.py, prompts of 24-384 tokens: 367 -> 390 output tok/s)."""
    if dtype == torch.bfloat16 and head_dim and _flash_prefill_runs(head_dim):
        return 0
    if dtype == torch.bfloat16 and num_heads >= 3 * num_kv_heads:
        return PAGED_PREFILL_MAX_CONTEXT
    return 0


def _flash_prefill_runs(head_dim: int) -> bool:
    library = cpu_kernels.load()
    return library is not None and library.ts_flash_prefill_supported(head_dim) == 1


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
class PagedRows:
    """The first rows of the step's flat batch, for the C kernel: row i's query attends to the
    first `context_lens[i]` tokens of its sequence, whose blocks are `block_ids[block_starts[i]:]`.
    The first `num_decodes` rows are the decode rows, sorted by context length; the rest belong to
    short prefill chunks (one row per token, each with its causal length)."""
    context_lens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # every sequence's blocks, concatenated
    block_starts: list[int] = field(default_factory=list)
    num_decodes: int = 0
    device: torch.device = torch.device("cpu")
    group_max_keys: int | None = None  # the gathering path's cap on one decode group's padded keys

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    def add_decode(self, context_len: int, block_ids: list[int]) -> None:
        self.add_prefill(context_len, 1, block_ids)
        self.num_decodes += 1

    def add_prefill(self, context_len: int, query_len: int, block_ids: list[int]) -> None:
        """`query_len` rows ending the sequence's first `context_len` tokens."""
        start = len(self.block_ids)
        self.block_ids.extend(block_ids)
        self.context_lens.extend(range(context_len - query_len + 1, context_len + 1))
        self.block_starts.extend([start] * query_len)

    @cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_ids, block_starts, context_lens) as int64 tensors, for the C kernel."""
        return tuple(torch.tensor(x, dtype=torch.long) for x in (self.block_ids, self.block_starts, self.context_lens))

    def groups(self, block_size: int) -> list[DecodeGroup]:
        """Decode rows in runs whose lengths stay within a factor of the run's first and, given
        `group_max_keys`, whose padded key count stays within it; each run's tables padded."""
        out = []
        for first, end in _length_runs(self.context_lens[:self.num_decodes], block_size, self.group_max_keys):
            width = -(-self.context_lens[end - 1] // block_size)
            tables = [self.block_ids[self.block_starts[i]:self.block_starts[i] + width] for i in range(first, end)]
            padded = [t + [0] * (width - len(t)) for t in tables]
            out.append(DecodeGroup(slice(first, end), torch.tensor(padded, dtype=torch.long, device=self.device),
                                   torch.tensor(self.context_lens[first:end], device=self.device)))
        return out


def _length_runs(context_lens: list[int], block_size: int, max_keys: int | None) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    first_blocks = 0
    for i, length in enumerate(context_lens):
        blocks = -(-length // block_size)
        too_long = blocks > DECODE_GROUP_GROWTH * first_blocks + 2
        too_many = max_keys is not None and runs and (i - runs[-1][0] + 1) * blocks * block_size > max_keys
        if not runs or too_long or too_many:
            runs.append((i, i))
            first_blocks = blocks
        runs[-1] = (runs[-1][0], i + 1)
    return runs


class AttentionMetadata:
    """What one step's attention needs besides q, k, v. Decode rows come as `PagedRows` (the
    runner) or as ready `DecodeGroup`s (tests, benchmarks); every prefill chunk as a
    `PrefillChunk`, the short ones also in `paged`."""

    def __init__(self, slot_mapping: torch.Tensor, block_size: int, decode_groups: list[DecodeGroup] | None = None,
                 prefills: list[PrefillChunk] | None = None, paged: PagedRows | None = None):
        self.slot_mapping = slot_mapping  # [T] int64: block_id * block_size + offset for each token
        self.block_size = block_size
        self.paged = paged
        self.prefills = prefills if prefills is not None else []
        self._decode_groups = decode_groups
        self._masks: dict = {}

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        if self._decode_groups is None:
            self._decode_groups = self.paged.groups(self.block_size) if self.paged is not None else []
        return self._decode_groups

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


@dataclass
class TorchMetadataBuilder:
    """Collects a step's sequences in flat-batch order (decode rows first) into `AttentionMetadata`."""
    block_size: int
    device: torch.device
    paged: PagedRows
    paged_prefill_max_context: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)

    def add_decode(self, context_len: int, block_ids: list[int], table_row: int = -1) -> None:
        """`block_ids` may run past the context (cut to it here); `table_row` is for the Triton builder."""
        self.paged.add_decode(context_len, block_ids[:-(-context_len // self.block_size)])

    def add_prefill(self, first_row: int, context_len: int, query_len: int, block_ids: list[int],
                    table_row: int = -1) -> None:
        block_ids = block_ids[:-(-context_len // self.block_size)]
        rows = slice(first_row, first_row + query_len)
        self.prefills.append(PrefillChunk(rows, context_len, query_len,
                                          torch.tensor(block_ids, dtype=torch.long).to(self.device)))
        if context_len <= self.paged_prefill_max_context and self.paged.num_rows == first_row:
            self.paged.add_prefill(context_len, query_len, block_ids)  # the paged rows stay a prefix of the batch

    def build(self, slot_mapping: torch.Tensor, stage=None) -> AttentionMetadata:
        """(`stage` is for the Triton builder: this one's tensors are made where they are used.)"""
        return AttentionMetadata(slot_mapping, self.block_size, prefills=self.prefills, paged=self.paged)


class TorchSDPABackend:
    """Attention with PyTorch's SDPA kernels over gathered cache blocks (and, on CPU, treeserve's
    C kernel for the paged rows). `paged_prefill_max_context`: see `paged_prefill_max_context()`;
    `decode_group_max_keys`: the cap on one gathered decode group's keys (None: no cap)."""

    name = "torch_sdpa"
    fuses_rotary = False  # the layer rotates q and k before `forward` (the Triton backend can do it itself)

    def __init__(self, paged_prefill_max_context: int = 0, decode_group_max_keys: int | None = None):
        self.paged_prefill_max_context = paged_prefill_max_context
        self.decode_group_max_keys = decode_group_max_keys

    def metadata_builder(self, block_size: int, device: torch.device, block_table=None) -> TorchMetadataBuilder:
        paged = PagedRows(device=device, group_max_keys=self.decode_group_max_keys)
        return TorchMetadataBuilder(block_size, device, paged, self.paged_prefill_max_context)

    def forward(
        self,
        layer_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D] (a view into the KV pages)
        q: torch.Tensor,            # [T, Hq, D]
        k: torch.Tensor,            # [T, Hkv, D]
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        self._write_cache(layer_cache, k, v, meta)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        done = self._paged_rows(layer_cache, q, meta, scale, window, softcap, out)
        for index, group in enumerate(meta.decode_groups if done == 0 else []):
            out[group.rows] = self._decode(layer_cache, q[group.rows], group, meta.decode_mask(index, window, q.dtype),
                                           scale, gqa, softcap)
        for index, chunk in enumerate(meta.prefills):
            if chunk.rows.stop > done and not self._flash_prefill(layer_cache, q, chunk, scale, window, softcap, out):
                out[chunk.rows] = self._prefill(layer_cache, q, k, v, meta, index, scale, window, gqa, softcap)
        return out

    @staticmethod
    def _flash_prefill(layer_cache, q, chunk: PrefillChunk, scale, window, softcap, out) -> bool:
        """A bfloat16 chunk through the C kernel with the CPU's bf16 dot products, straight into
        `out` (the chunk's keys are in the cache already): whether it ran."""
        if window is not None or softcap is not None or q.dtype != torch.bfloat16:
            return False
        library = cpu_kernels.library_for(q)
        if library is None:
            return False
        return cpu_kernels.flash_prefill(library, q[chunk.rows], layer_cache, chunk.block_ids, chunk.context_len,
                                         scale, out[chunk.rows]) is not None

    @staticmethod
    def _paged_rows(layer_cache, q, meta: AttentionMetadata, scale, window, softcap, out) -> int:
        """The paged rows through the C kernel, where it runs: how many rows it did (0: none)."""
        paged = meta.paged
        if paged is None or paged.num_rows == 0:
            return 0
        if not cpu_kernels.supports(q.dtype, q.device, q.shape[1], layer_cache.shape[3], q.shape[2]):
            return 0
        library = cpu_kernels.load()
        if library is None:
            return 0
        rows = paged.num_rows
        cpu_kernels.paged_attention(library, q[:rows], layer_cache, *paged.tensors, scale, window, out[:rows], softcap)
        return rows

    @staticmethod
    def _write_cache(layer_cache, k, v, meta: AttentionMetadata):
        library = cpu_kernels.library_for(k)
        if library is not None and cpu_kernels.can_write_kv(layer_cache, k, v, meta.slot_mapping):
            cpu_kernels.write_kv(library, layer_cache, k, v, meta.slot_mapping)
            return
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

    def _prefix_reader(self, layer_cache, block_ids: torch.Tensor) -> prefix_attention.GatherPrefix:
        """Reads tokens [start, end) of a sequence whose blocks are `block_ids` as keys and values
        [Hkv, end - start, D]."""
        block_size = layer_cache.shape[2]

        def read(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            blocks = block_ids[start // block_size:-(-end // block_size)]
            first = start % block_size
            return (self._gather(layer_cache[:, 0], blocks)[:, first:first + end - start],
                    self._gather(layer_cache[:, 1], blocks)[:, first:first + end - start])
        return read

    def _decode(self, layer_cache, q, group, mask, scale, gqa, softcap):
        keys = self._gather(layer_cache[:, 0], group.block_tables)
        values = self._gather(layer_cache[:, 1], group.block_tables)
        if (q.device.type == "cpu" and q.dtype != torch.float32) or softcap is not None:
            return decode_by_matmul(q, keys, values, mask, scale, softcap)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        return out.squeeze(2)

    def _prefill(self, layer_cache, q, k, v, meta: AttentionMetadata, index: int, scale, window, gqa, softcap):
        chunk = meta.prefills[index]
        prefix_len = chunk.context_len - chunk.query_len
        if prefix_len and prefix_attention.supported(q, window, softcap):
            return prefix_attention.chunk_over_prefix(q[chunk.rows], k[chunk.rows], v[chunk.rows], prefix_len,
                                                      self._prefix_reader(layer_cache, chunk.block_ids), scale)
        mask = meta.prefill_mask(index, window)
        query = q[chunk.rows].transpose(0, 1).unsqueeze(0)
        if chunk.context_len == chunk.query_len:
            keys = k[chunk.rows].transpose(0, 1).unsqueeze(0)
            values = v[chunk.rows].transpose(0, 1).unsqueeze(0)
        else:
            keys = self._gather(layer_cache[:, 0], chunk.block_ids)[:, : chunk.context_len].unsqueeze(0)
            values = self._gather(layer_cache[:, 1], chunk.block_ids)[:, : chunk.context_len].unsqueeze(0)
        if softcap is not None:
            return prefill_by_matmul(query[0], keys[0], values[0], mask, scale, softcap).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        return out.squeeze(0).transpose(0, 1)


def _soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def decode_by_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: [B, Hq, D] queries over [B, Hkv, L, D] keys and values with an
    additive [B, 1, 1, L] mask. Query heads sharing a KV head are one matrix product, so keys are
    never repeated; softmax runs in float32 (as HF's eager attention does), after the soft cap.

    On CPU in bfloat16, PyTorch's SDPA kernel is two to four times slower than this for one query
    token (`benchmarks/decode_attention.py --dtype bfloat16`); in float32 SDPA is the faster.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    # scaled before the product, so that float16 dot products cannot overflow
    grouped = (q * scale).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = _soft_cap(torch.matmul(grouped, keys.transpose(-1, -2)).float(), softcap) + mask
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)


def prefill_by_matmul(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, softcap: float | None) -> torch.Tensor:
    """One prefill chunk, [Hq, Q, D] queries over [Hkv, L, D] keys and values, `mask` [Q, L] boolean
    (None: causal over the chunk itself), scores soft-capped before a float32 softmax; [Hq, Q, D].
    Query heads sharing a KV head are one matrix product. Holds a [Hq, Q, L] score matrix: chunked
    prefill bounds Q."""
    num_heads, query_len, head_dim = query.shape
    num_kv_heads, key_len = keys.shape[0], keys.shape[1]
    if mask is None:
        mask = torch.ones(query_len, key_len, dtype=torch.bool, device=query.device).tril(key_len - query_len)
    grouped = (query * scale).reshape(num_kv_heads, -1, head_dim)  # [Hkv, group * Q, D]
    scores = _soft_cap(torch.matmul(grouped, keys.transpose(-1, -2)).float(), softcap)
    scores = scores.view(num_heads, query_len, key_len).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads, -1, key_len)
    return torch.matmul(probs, values).view(num_heads, query_len, head_dim)
