"""One page of the KV cache as the block pool and its eviction policy see it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    owner: str = ""  # which model's data the block holds (a pool can be shared by several models)
    reused: bool = False  # a second request took it (prefix hit or fork) since it was filled
    freed_at: int = 0     # when its last reference was dropped (orders the free queues)
    wanted_by: str | None = None  # the model whose waiting requests will hit this block (evicted last)
