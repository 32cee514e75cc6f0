"""Attention through treeserve's Triton kernels (`model/kernels/`): the GPU path.

One launch writes the step's keys and values by slot, one attends for the whole flat batch
(decode rows and prefill chunks alike). A decode-only step of few sequences, too few to fill the
device with one program per (sequence, KV head), splits each sequence's keys instead.
Every tensor of `TritonMetadata` has a fixed shape for a given batch size, so a CUDA graph can
capture a decode step over static copies of them (`engine/cuda_graphs.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treeserve.model.hf_config import ModelConfig
from treeserve.model.transfer import to_device

MAX_SPLITS = 32
# decode-only steps split keys until there are this many programs per multiprocessor (measured on an
# H200 by benchmarks/gpu_attention.py: see docs/BENCHMARKS.md)
SPLIT_PROGRAMS_PER_SM = 4  # H200 sweep, 2026-11-26 (docs/BENCHMARKS.md): split below 4 programs per SM


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor     # [T] int64; -1 writes nothing
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence i's query rows start there
    seq_lens: torch.Tensor         # [B] int32: tokens of sequence i after this step
    block_tables: torch.Tensor     # [B, W] int32
    max_query_len: int
    split_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # split-KV decode's partials


@dataclass
class TritonMetadataBuilder:
    """Collects a step's sequences in flat-batch order, then makes their tensors on the device."""
    backend: "TritonBackend"
    device: torch.device
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)

    def add_decode(self, context_len: int, block_ids: list[int]) -> None:
        self.add_prefill(len(self.query_lens), context_len, 1, block_ids)

    def add_prefill(self, first_row: int, context_len: int, query_len: int, block_ids: list[int]) -> None:
        self.query_lens.append(query_len)
        self.seq_lens.append(context_len)
        self.tables.append(block_ids)

    def build(self, slot_mapping: torch.Tensor) -> TritonMetadata:
        width = max((len(t) for t in self.tables), default=1)
        # one conversion of the padded lists (numpy's is ~10x faster than a tensor per row)
        tables = torch.from_numpy(np.array([t + [0] * (width - len(t)) for t in self.tables], dtype=np.int32)
                                  .reshape(len(self.tables), width))
        starts = torch.zeros(len(self.query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(self.query_lens, dtype=torch.int32).cumsum(0)
        max_query_len = max(self.query_lens, default=0)
        meta = TritonMetadata(slot_mapping, to_device(starts, self.device),
                              to_device(torch.tensor(self.seq_lens, dtype=torch.int32), self.device),
                              to_device(tables, self.device), max_query_len)
        if max_query_len == 1:
            meta.split_buffers = self.backend.split_buffers(len(self.seq_lens), self.device)
        return meta


class TritonBackend:
    """`split_kv_min_programs`: a decode-only step with fewer (sequence, KV head) programs than this
    splits keys, into enough ranges to reach it (`SPLIT_PROGRAMS_PER_SM` per multiprocessor on CUDA;
    0, never, unless a test sets it)."""

    name = "triton"
    paged_prefill_max_context = 0  # the torch backend's C-kernel routing; nothing to route here

    def __init__(self, config: ModelConfig, device: torch.device):
        from treeserve.model.kernels import kv_write, paged_attention  # compiled (or interpreted) on first use

        self._kernels, self._write = paged_attention, kv_write
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.split_kv_min_programs = 0
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.split_kv_min_programs = SPLIT_PROGRAMS_PER_SM * sms

    def metadata_builder(self, block_size: int, device: torch.device) -> TritonMetadataBuilder:
        return TritonMetadataBuilder(self, device)

    def num_splits(self, num_seqs: int) -> int:
        """Key ranges per sequence for a decode-only step (0: the unified kernel): a power of two
        that brings the programs to `split_kv_min_programs`. The split kernel's programs each walk a
        shorter range of keys; one program per (sequence, KV head) walking a 1k-token context one
        tile at a time is latency-bound, not bandwidth-bound."""
        programs = num_seqs * self.num_kv_heads
        if programs == 0 or programs >= self.split_kv_min_programs:
            return 0
        wanted = -(-self.split_kv_min_programs // programs)
        return min(MAX_SPLITS, 1 << (wanted - 1).bit_length())

    def split_buffers(self, num_seqs: int, device: torch.device):
        splits = self.num_splits(num_seqs)
        if splits == 0:
            return None
        return self._kernels.split_kv_buffers(num_seqs, self.num_heads, self.head_dim, splits, device)

    def forward(self, layer_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
        k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]
        self._write.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.split_buffers is not None:
            self._kernels.split_kv_decode(q, k_cache, v_cache, out, meta.seq_lens, meta.block_tables, scale, window,
                                          meta.split_buffers, softcap)
        else:
            self._kernels.unified_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                            meta.block_tables, scale, window, softcap=softcap)
        return out

