"""Kept KV: finished prefill-only sequences whose blocks stay pinned under their request id, so a
later request that extends their tokens (`parent_id`) computes only the new ones. Least recently
used first; released on demand or, one at a time, when the pool runs out of free blocks."""
from __future__ import annotations

from collections import OrderedDict

from treeserve.errors import ParamError
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import Request


class KeptSequences:
    def __init__(self, kv: KVCacheManager | None = None):
        self.kv = kv
        self.sequences: OrderedDict[str, Request] = OrderedDict()
        self._block_refs: dict[int, int] = {}  # block id -> kept sequences holding it

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def values(self):
        return self.sequences.values()

    def keep(self, request_id: str, request: Request) -> None:
        self.sequences[request_id] = request
        for block in self.kv.live_blocks(request.request_id):
            self._block_refs[block.block_id] = self._block_refs.get(block.block_id, 0) + 1

    def parent(self, parent_id: str | None, prompt_token_ids: list[int]) -> Request | None:
        """The kept sequence that the prompt extends; None when it was released (the prefix cache
        may still hold its full blocks)."""
        if parent_id is None:
            return None
        parent = self.sequences.get(parent_id)
        if parent is None:
            return None
        done = parent.num_computed_tokens
        if len(prompt_token_ids) <= done or prompt_token_ids[:done] != parent.all_token_ids[:done]:
            raise ParamError("parent_id", f"the prompt does not extend the tokens kept under {parent_id!r}")
        self.sequences.move_to_end(parent_id)
        return parent

    def release(self, request_id: str) -> None:
        """Frees a kept sequence's blocks (its full blocks stay prefix-cached)."""
        request = self.sequences.pop(request_id, None)
        if request is not None:
            for block in self.kv.live_blocks(request.request_id):
                left = self._block_refs.pop(block.block_id) - 1
                if left:
                    self._block_refs[block.block_id] = left
            self.kv.free(request)

    def release_first(self, request_id: str) -> None:
        """Moves a kept sequence to the front of the release order (the next one `release_oldest`
        frees): its owner expects no request to extend it soon."""
        if request_id in self.sequences:
            self.sequences.move_to_end(request_id, last=False)

    def release_oldest(self) -> bool:
        if not self.sequences:
            return False
        self.release(next(iter(self.sequences)))
        return True

    def num_blocks(self) -> int:
        """Blocks the kept sequences hold (a block shared by two counts once). Kept up to date as
        sequences come and go, so reading it from another thread (a metrics scrape) is safe."""
        return len(self._block_refs)
