"""Tensor parallelism (Megatron-style) over torch.distributed: which part of each weight a rank holds,
and the collectives that join the parts.

Of `world_size` ranks, rank r holds: its share of the query heads and of the K/V heads (a K/V head
replicated on several ranks where there are fewer K/V heads than ranks), so q/k/v and the KV cache
are column-parallel by heads; its share of the MLP's intermediate rows (gate/up column-parallel);
o_proj and down_proj row-parallel, summed across ranks by an all-reduce; a contiguous share of the
vocabulary for the embedding (each rank looks up the ids it holds, an all-reduce joins them) and the
lm_head (the ranks' logits are gathered). A vocabulary that does not divide evenly is padded at the
end; padded rows are zero and their logits are cut off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from treeserve.errors import ParamError


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: object = None  # the torch.distributed process group (None: the default one)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """x, in place, the elementwise largest over the ranks."""
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' [..., n] parts side by side: [..., world_size * n]."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class ShardPlan:
    """Where rank `rank`'s slices of a model of this shape start, and how long they are."""
    tp: TensorParallel
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def check(cls, tp: TensorParallel, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
              vocab_size: int) -> "ShardPlan":
        n = tp.world_size
        if num_heads % n:
            raise ParamError("tensor_parallel_size", f"{n} does not divide the model's {num_heads} attention heads")
        if num_kv_heads % n and n % num_kv_heads:
            raise ParamError("tensor_parallel_size", f"{n} neither divides nor is a multiple of the model's "
                             f"{num_kv_heads} key/value heads")
        if intermediate_size % n:
            raise ParamError("tensor_parallel_size", f"{n} does not divide the MLP's {intermediate_size} rows")
        return cls(tp, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp.world_size)

    @property
    def first_kv_head(self) -> int:
        """This rank's first K/V head (with replication, the one whose query heads it holds)."""
        return self.tp.rank * self.num_kv_heads // self.tp.world_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.tp.world_size

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab_size // self.tp.world_size)

    @property
    def vocab_start(self) -> int:
        return self.tp.rank * self.vocab_shard

    def qkv_rows(self) -> list[tuple[int, int]]:
        """(start, end) rows of the checkpoint's q, k and v projections this rank holds."""
        q = self.tp.rank * self.local_heads * self.head_dim
        kv = self.first_kv_head * self.head_dim
        width = self.local_kv_heads * self.head_dim
        return [(q, q + self.local_heads * self.head_dim), (kv, kv + width), (kv, kv + width)]

    def mlp_rows(self) -> tuple[int, int]:
        start = self.tp.rank * self.local_intermediate
        return start, start + self.local_intermediate

    def vocab_rows(self) -> tuple[int, int]:
        """This rank's vocabulary rows, clipped to the real vocabulary (the rest is zero padding)."""
        return min(self.vocab_start, self.vocab_size), min(self.vocab_start + self.vocab_shard, self.vocab_size)


class VocabParallelEmbedding(torch.nn.Module):
    """The embedding rows [vocab_start, vocab_start + shard) of one rank; ids elsewhere look up zero."""

    def __init__(self, shard_rows: int, hidden: int, vocab_start: int, tp: TensorParallel):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shard_rows, hidden))
        self.vocab_start, self.tp = vocab_start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)
