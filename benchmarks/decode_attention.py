"""Decode attention on CPU: one group per context length against groups capped by gathered keys,
the kernel for one query token, PyTorch's SDPA against `decode_by_matmul`, and the gathering path
against treeserve's C kernel reading the paged cache in place (`cpu_kernels.paged_attention`).

The model runner groups decoding sequences by context length and, on CPU, also caps each group's
gathered keys (`CPU_DECODE_GROUP_MAX_KEYS`). This times `TorchSDPABackend` on one decode step's
attention for batches shaped like beam search's (many sequences, a few hundred tokens each), with
the groups built both ways from the same sequences, and prints the medians and their ratio. Then
it times the two kernels on one group's gathered keys (the backend uses the matmul one on CPU
outside float32) and prints their medians, ratio and largest difference.

    python benchmarks/decode_attention.py [--dtype float32|bfloat16] [--batches 16,144,480] [--context 160]
        [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from torch.nn import functional as F

from treeserve.model import cpu_kernels
from treeserve.model.attention import AttentionMetadata, DecodeGroup, PagedRows, TorchSDPABackend, decode_by_matmul
from treeserve.model.backends import CPU_DECODE_GROUP_MAX_KEYS

BLOCK_SIZE, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 16, 4, 32, 8192


def decode_step(batch: int, context: int, max_keys: int | None, generator: torch.Generator):
    """A flat decode batch of `batch` sequences of about `context` tokens, grouped in runs whose
    padded key count stays within `max_keys` (None: one group)."""
    lens = torch.randint(context - BLOCK_SIZE + 1, context + 1, (batch,), generator=generator).sort().values
    width = -(-context // BLOCK_SIZE)
    tables = torch.randint(0, NUM_BLOCKS, (batch, width), generator=generator)
    per_group = batch if max_keys is None else max(1, max_keys // (width * BLOCK_SIZE))
    groups = [DecodeGroup(slice(i, min(i + per_group, batch)), tables[i:i + per_group], lens[i:i + per_group])
              for i in range(0, batch, per_group)]
    slots = tables[torch.arange(batch), (lens - 1) // BLOCK_SIZE] * BLOCK_SIZE + (lens - 1) % BLOCK_SIZE
    return AttentionMetadata(slot_mapping=slots, block_size=BLOCK_SIZE, decode_groups=groups)


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            run()
        times.append((time.perf_counter() - start) / 10 * 1e3)
    return statistics.median(times)


def compare_grouping(backend, cache, batch: int, args, generator) -> None:
    q = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=generator).to(cache.dtype)
    k, v = torch.randn_like(q), torch.randn_like(q)
    one = decode_step(batch, args.context, None, torch.Generator().manual_seed(batch))
    capped = decode_step(batch, args.context, CPU_DECODE_GROUP_MAX_KEYS, torch.Generator().manual_seed(batch))
    same = torch.allclose(backend.forward(cache.clone(), q, k, v, one, HEAD_DIM ** -0.5, None),
                          backend.forward(cache.clone(), q, k, v, capped, HEAD_DIM ** -0.5, None), atol=1e-6)
    base = median_ms(lambda: backend.forward(cache, q, k, v, one, HEAD_DIM ** -0.5, None), args.repeats)
    fast = median_ms(lambda: backend.forward(cache, q, k, v, capped, HEAD_DIM ** -0.5, None), args.repeats)
    print(f"batch {batch:4d}: one group {base:7.2f} ms, {len(capped.decode_groups)} capped groups {fast:7.2f} ms, "
          f"ratio {base / fast:.2f}, same output {same}")


def compare_kernels(cache, batch: int, args, generator) -> None:
    """Query heads twice the KV heads (grouped-query attention), as in the bundled models."""
    meta = decode_step(batch, args.context, None, torch.Generator().manual_seed(batch))
    group = meta.decode_groups[0]
    keys = TorchSDPABackend._gather(cache[:, 0], group.block_tables)
    values = TorchSDPABackend._gather(cache[:, 1], group.block_tables)
    q = torch.randn(batch, 2 * KV_HEADS, HEAD_DIM, generator=generator).to(cache.dtype)
    mask = meta.decode_mask(0, None, cache.dtype)
    scale = HEAD_DIM ** -0.5

    def sdpa():
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True).squeeze(2)

    def matmul():
        return decode_by_matmul(q, keys, values, mask, scale)

    gap = (sdpa().float() - matmul().float()).abs().max().item()
    slow, fast = median_ms(sdpa, args.repeats), median_ms(matmul, args.repeats)
    print(f"batch {batch:4d}: SDPA {slow:7.2f} ms, matmul {fast:7.2f} ms, ratio {slow / fast:.2f}, "
          f"largest difference {gap:.1e}")


def compare_paged(backend, cache, batch: int, args, generator) -> None:
    """The same decode step through the capped groups (gathers) and through the C kernel."""
    q = torch.randn(batch, 2 * KV_HEADS, HEAD_DIM, generator=generator).to(cache.dtype)
    k, v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=generator).to(cache.dtype), torch.randn(
        batch, KV_HEADS, HEAD_DIM, generator=generator).to(cache.dtype)
    capped = decode_step(batch, args.context, CPU_DECODE_GROUP_MAX_KEYS, torch.Generator().manual_seed(batch))
    paged = PagedRows()
    for group in capped.decode_groups:
        for table, length in zip(group.block_tables.tolist(), group.context_lens.tolist()):
            paged.add_decode(length, table[:-(-length // BLOCK_SIZE)])
    kernel = AttentionMetadata(slot_mapping=capped.slot_mapping, block_size=BLOCK_SIZE, paged=paged)
    scale = HEAD_DIM ** -0.5
    gap = (backend.forward(cache, q, k, v, capped, scale, None).float()
           - backend.forward(cache, q, k, v, kernel, scale, None).float()).abs().max().item()
    slow = median_ms(lambda: backend.forward(cache, q, k, v, capped, scale, None), args.repeats)
    fast = median_ms(lambda: backend.forward(cache, q, k, v, kernel, scale, None), args.repeats)
    print(f"batch {batch:4d}: gathered groups {slow:7.2f} ms, C kernel {fast:7.2f} ms, ratio {slow / fast:.2f}, "
          f"largest difference {gap:.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batches", default="16,144,480")
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    backend, generator = TorchSDPABackend(), torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {KV_HEADS} KV heads of {HEAD_DIM}, "
          f"context ~{args.context}, cap {CPU_DECODE_GROUP_MAX_KEYS} keys per group")
    for batch in batches:
        compare_grouping(backend, cache, batch, args, generator)
    print("one query token, one group: PyTorch's SDPA against decode_by_matmul")
    for batch in batches:
        compare_kernels(cache, batch, args, generator)
    if cpu_kernels.load() is None:
        print("C kernel: not built here (no C compiler, or TREESERVE_CPU_KERNELS=0)")
        return 0
    print("2 query heads per KV head: gathered capped groups against the C kernel on the paged cache")
    for batch in batches:
        compare_paged(backend, cache, batch, args, generator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
