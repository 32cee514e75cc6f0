"""KV memory as fixed-size byte pages.

One zeroed `[num_pages, page_bytes]` buffer; a model views each page as one KV block holding all
its layers (`[layers, 2, block_size, kv_heads, head_dim]` in its dtype). Because pages are sized
in bytes, models with different per-token sizes can draw from one arena: each gets a block size
(tokens per page) that fills the page. Zeroed, not empty: masked-out slots still enter SDPA's
weighted sum (as 0 * value), and uninitialised memory can hold NaN.
"""
from __future__ import annotations

import itertools

import torch

from treeserve.errors import ParamError
from treeserve.model.hf_config import ModelConfig
from treeserve.model.transfer import to_device

PAGE_ALIGN = 64
_SERIALS = itertools.count(1)  # names an arena for tensor-parallel workers (ids of freed objects recur)
# Page sizes idling up to this much more than the tightest fit count as fitting as well: the
# largest of them is taken (smaller blocks cost each step more bookkeeping per token, so a page is cut
# only where that returns more than a sliver of memory).
IDLE_TOLERANCE = 0.02


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8


def aligned(nbytes: int) -> int:
    return -(-nbytes // PAGE_ALIGN) * PAGE_ALIGN


def fitted_page_bytes(bytes_per_token: list[int], block_size: int) -> int:
    """Bytes per page for models sharing an arena: `block_size` tokens of the smallest model, or
    down to half as many where that wastes less of each page on the others (a model whose
    per-token size does not divide the page leaves the remainder idle). For 2 and 6 KiB per
    token, 16-token pages leave 2 of every 32 KiB idle in the larger model's pages; 15-token
    pages leave none."""
    smallest = min(bytes_per_token)

    def idle(tokens: int) -> float:
        page = aligned(tokens * smallest)
        return sum(page - page // b * b for b in bytes_per_token) / (page * len(bytes_per_token))

    candidates = range(block_size, max(1, (block_size + 1) // 2) - 1, -1)
    least = min(idle(t) for t in candidates)
    tokens = next(t for t in candidates if idle(t) <= least + IDLE_TOLERANCE)
    return tokens * smallest


class KVArena:
    def __init__(self, num_pages: int, page_bytes: int, device: torch.device):
        if num_pages < 1:
            raise ParamError("kv_cache_memory_bytes", f"room for no KV page of {page_bytes} bytes")
        self.page_bytes = aligned(page_bytes)
        self.pages = torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=device)
        self.num_pages, self.nbytes = num_pages, self.pages.nbytes  # (still read once released)
        self.serial = next(_SERIALS)

    @property
    def released(self) -> bool:
        return self.pages.numel() == 0

    def release(self) -> None:
        """Frees the pages now, under every view of them (the models' per-layer caches, CUDA graphs,
        draft KV), not when the last view goes: for the arena's owner to call once nothing runs on it."""
        self.pages.untyped_storage().resize_(0)
        self.pages = self.pages.new_empty(0, self.page_bytes)

    def block_size_for(self, config: ModelConfig, dtype: torch.dtype) -> int:
        """Tokens of this model that fit in one page."""
        return self.page_bytes // kv_bytes_per_token(config, dtype)

    def layer_views(self, config: ModelConfig, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer, a `[num_pages, 2, block_size, kv_heads, head_dim]` view into the pages."""
        block_size = self.block_size_for(config, dtype)
        if block_size < 1:
            raise ValueError(f"a KV page of {self.page_bytes} bytes cannot hold one token of this model")
        shape = (config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
        used = block_size * kv_bytes_per_token(config, dtype)
        typed = self.pages[:, :used].view(dtype)
        blocks = typed.view(self.num_pages, *shape)
        return [blocks[:, layer] for layer in range(config.num_layers)]

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Each (source, destination) page copied whole (copy-on-write of a forked sequence's last block)."""
        if not copies:
            return
        if self.pages.device.type == "cpu":
            # a page at a time: ~8x faster here than the indexed gather and scatter (~2.6 GB/s for uint8 rows)
            for source, destination in copies:
                self.pages[destination].copy_(self.pages[source])
            return
        # one gather and scatter on the device; the pairs pinned and non-blocking (a pageable copy would
        # make the host wait for the device)
        pairs = to_device(torch.tensor(copies, dtype=torch.long), self.pages.device)
        self.pages[pairs[:, 1]] = self.pages[pairs[:, 0]]
