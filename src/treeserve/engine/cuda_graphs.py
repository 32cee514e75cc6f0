"""CUDA graphs for decode-only steps (the Triton attention backend on CUDA).

A decode step launches a few hundred small kernels; replaying them as one graph takes the host out
of the step. Graphs are captured at start for batch-size buckets (1, 2, 4, 8, then every 16 up to
`max_num_seqs`, which is a bucket too), largest first into one memory pool. Each reads static
buffers: input ids, positions, slot mapping, sequence lengths, block tables. A step of n rows
replays the smallest bucket >= n; its rows past n are padding: slot -1 (the K/V write skips it)
and sequence length 0 (attention reads no key), so they touch no cache block. Logits and
sampling stay outside the graph. Prefill chunks, mixed steps and batches past the largest bucket
run eagerly. `enforce_eager` turns graphs off.

Without CUDA (`use_graphs=False`) the same buffers and padding run eagerly, which is how the
tests check them on CPU.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.triton_backend import TritonMetadata

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = {s for s in SMALL_BUCKETS if s <= max_num_seqs} | set(range(BUCKET_STEP, max_num_seqs + 1, BUCKET_STEP))
    return sorted(sizes | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, use_graphs: bool = True):
        self.model, self.kv_caches, self.device, self.use_graphs = model, kv_caches, device, use_graphs
        self.sizes = capture_sizes(max_num_seqs)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.metas: dict[int, TritonMetadata] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures every bucket (largest first, one memory pool); returns the seconds it took."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self.metas[size] = self._static_metadata(size)
            if self.use_graphs:
                pool = self._capture(size, pool)
        seconds = time.perf_counter() - start
        if self.use_graphs:
            logger.info("captured %d CUDA graphs for decode batches of 1-%d in %.1f s", len(self.sizes),
                        self.sizes[-1], seconds)
        return seconds

    def _static_metadata(self, size: int) -> TritonMetadata:
        return TritonMetadata(self.slot_mapping[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
                              self.block_tables[:size], max_query_len=1,
                              split_buffers=self.model.backend.split_buffers(size, self.device))

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.metas[size])

    def _capture(self, size: int, pool):
        self._forward(size)  # warm-up: compiles the kernels, settles the allocator
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with _no_collection():
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
        self.graphs[size] = (graph, hidden)
        return graph.pool() if pool is None else pool

    def fits(self, num_rows: int, meta) -> bool:
        """A decode-only step of the Triton backend that some bucket holds."""
        return (isinstance(meta, TritonMetadata) and meta.max_query_len == 1 and 0 < num_rows <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1] and bool(self.metas))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TritonMetadata) -> torch.Tensor:
        """The step's hidden states [n, hidden], from the smallest bucket that holds its n rows."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:size].zero_()
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self.num_replays += 1
        if not self.use_graphs:
            return self._forward(size)[:n]
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]


@contextlib.contextmanager
def _no_collection():
    """The garbage collector collected first, then paused while a graph is captured: a collection
    during capture could free another engine's graphs, and destroying a graph is not permitted while
    a stream is capturing (the capture then fails: "operation not permitted when stream is capturing")."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def decode_graphs(loaded, kv_caches, block_size: int) -> DecodeGraphs | None:
    """A loaded model's decode-step CUDA graphs over its KV caches, captured now: with Triton attention
    on CUDA, unless enforce_eager (and not yet with tensor parallelism or mixture-of-experts routing)."""
    config = loaded.config
    if loaded.attention_backend != "triton" or loaded.device.type != "cuda" or config.enforce_eager:
        return None
    if loaded.executor is not None:
        logger.info("tensor parallel: decode steps run eagerly (workers capture no CUDA graphs yet)")
        return None
    if loaded.model_config.moe is not None:  # its experts' grouping reads the routing on the host
        logger.info("mixture of experts: decode steps run eagerly (no CUDA graphs)")
        return None
    graphs = DecodeGraphs(loaded.model, kv_caches, config.max_num_seqs, -(-loaded.max_model_len // block_size),
                          loaded.device)
    graphs.capture()
    return graphs
