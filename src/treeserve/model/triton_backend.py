"""Attention through treeserve's Triton kernels (`model/kernels/`): the GPU path.

One launch writes the step's keys and values by slot, one attends for the whole flat batch
(decode rows and prefill chunks alike). The backend rotates q and k itself (`fuses_rotary`): the
layer hands it the rotary tables and positions unapplied, and one launch rotates q in place and
writes the rotated keys and the values into the cache (`kernels/rotary_kv.py`; off with
`TREESERVE_FUSED_ROTARY_KV=0`: the layer rotates, then the write). A decode-only step of few
sequences, too few to fill the device with one program per (sequence, KV head), splits each
sequence's keys instead.
Every tensor of `TritonMetadata` has a fixed shape for a given batch size, so a CUDA graph can
capture a decode step over static copies of them (`engine/cuda_graphs.py`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from treeserve.model.hf_config import ModelConfig
from treeserve.model.layers import RotaryInputs
from treeserve.model.transfer import values_to_device

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
    """Collects a step's sequences in flat-batch order, then makes their tensors on the device. A
    sequence's `block_ids` may run past its context (they are cut to it); given the runner's
    `BlockTable` and every sequence's row of it, the step's tables are one gather of those rows."""
    backend: "TritonBackend"
    device: torch.device
    block_size: int
    block_table: Any = None  # the runner's `engine.block_table.BlockTable`, or None: lists only
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    table_rows: list[int] = field(default_factory=list)  # -1: not in the block table (`tables` has it)

    def add_decode(self, context_len: int, block_ids: list[int], table_row: int = -1) -> None:
        self.query_lens.append(1)
        self.seq_lens.append(context_len)
        self.tables.append(block_ids)
        self.table_rows.append(table_row)

    def add_prefill(self, first_row: int, context_len: int, query_len: int, block_ids: list[int],
                    table_row: int = -1) -> None:
        self.query_lens.append(query_len)
        self.seq_lens.append(context_len)
        self.tables.append(block_ids)
        self.table_rows.append(table_row)

    def build(self, slot_mapping: torch.Tensor, stage=None) -> TritonMetadata:
        """`stage(values, dtype, shape=None)`: values' place on the device (the runner's
        `StepStaging.stage`; by default a copy of their own)."""
        stage = stage or (lambda values, dtype, shape=None: values_to_device(values, dtype, self.device, shape))
        width = max((-(-n // self.block_size) for n in self.seq_lens), default=1)
        starts = [0, *itertools.accumulate(self.query_lens)]
        tables = self._tables(width)
        meta = TritonMetadata(slot_mapping, stage(starts, torch.int32), stage(self.seq_lens, torch.int32),
                              stage(tables, torch.int32, tables.shape), max(self.query_lens, default=0))
        if meta.max_query_len == 1:
            meta.split_buffers = self.backend.split_buffers(len(self.seq_lens), self.device)
        return meta

    def _tables(self, width: int) -> np.ndarray:
        """[sequences, width] int32: rows gathered from the block table, else the lists padded (one
        numpy conversion: ~10x faster than a tensor per row)."""
        if self.block_table is not None and self.table_rows and min(self.table_rows) >= 0:
            return self.block_table.rows(self.table_rows, width)
        cut = [t[:-(-n // self.block_size)] for t, n in zip(self.tables, self.seq_lens)]
        return np.array([t + [0] * (width - len(t)) for t in cut], dtype=np.int32).reshape(len(cut), width)


class TritonBackend:
    """`split_kv_min_programs`: a decode-only step with fewer (sequence, KV head) programs than this
    splits keys, into enough ranges to reach it (`SPLIT_PROGRAMS_PER_SM` per multiprocessor on CUDA;
    0, never, unless a test sets it). `fuses_rotary`: `forward` takes the layer's rotary unapplied
    (`rotary=`) and applies it in its K/V write's launch (`kernels.FUSED_ROTARY_KV`)."""

    name = "triton"
    paged_prefill_max_context = 0  # the torch backend's C-kernel routing; nothing to route here

    def __init__(self, config: ModelConfig, device: torch.device):
        from treeserve.model import kernels
        # compiled (or interpreted) on first use
        from treeserve.model.kernels import kv_write, paged_attention, rotary_kv

        self._kernels, self._write, self._rotary_kv = paged_attention, kv_write, rotary_kv
        self.fuses_rotary = kernels.FUSED_OPS and kernels.FUSED_ROTARY_KV
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.split_kv_min_programs = 0
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.split_kv_min_programs = SPLIT_PROGRAMS_PER_SM * sms

    def metadata_builder(self, block_size: int, device: torch.device, block_table=None) -> TritonMetadataBuilder:
        return TritonMetadataBuilder(self, device, block_size, block_table)

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
                meta: TritonMetadata, scale: float, window: int | None, softcap: float | None = None,
                rotary: RotaryInputs | None = None) -> torch.Tensor:
        """`rotary`: q and k still to rotate (only where `fuses_rotary`); q is rotated in place, the
        cache gets the rotated keys, the k tensor is left as it came."""
        k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]
        if rotary is not None:
            self._rotary_kv.rotary_write_kv(q, k, v, k_cache, v_cache, meta.slot_mapping, *rotary)
        else:
            self._write.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.split_buffers is not None:
            self._kernels.split_kv_decode(q, k_cache, v_cache, out, meta.seq_lens, meta.block_tables, scale, window,
                                          meta.split_buffers, softcap)
        else:
            self._kernels.unified_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                            meta.block_tables, scale, window, softcap=softcap)
        return out

