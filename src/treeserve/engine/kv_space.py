"""The KV memory an engine draws from: an arena of byte pages (the runner's side) with the block
pool that hands its pages out (the scheduler's side). Kept apart from `kv_arena` so that the runner,
which writes into the pages, never imports the pool (tests/test_step_data.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.engine.block_pool import BlockPool
from treeserve.engine.kv_arena import KVArena, aligned
from treeserve.errors import ParamError


@dataclass
class KVSpace:
    """The KV memory an engine draws from: byte pages and the pool that hands them out."""
    arena: KVArena
    pool: BlockPool

    @classmethod
    def create(cls, budget_bytes: int, page_bytes: int, device: torch.device, enable_caching: bool,
               reclaim=None) -> "KVSpace":
        """`reclaim(owner)`: the pool's way to free a kept sequence before evicting shared prefixes."""
        num_pages = budget_bytes // aligned(page_bytes)
        if num_pages < 1:
            raise ParamError("kv_cache_memory_bytes", f"{budget_bytes} bytes hold no KV page of {page_bytes} bytes")
        return cls(KVArena(num_pages, page_bytes, device), BlockPool(num_pages, enable_caching, reclaim))

    def release(self) -> None:
        """Frees the arena's pages (its owner's call, once no engine runs on it); the pool's counts,
        which statistics read, stay."""
        self.arena.release()
