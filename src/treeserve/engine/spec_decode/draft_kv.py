"""The KV of a drafter that runs passes of its own (a draft model, an EAGLE head): per request, blocks
from the target's block pool (as an owner of its own) in the target's KV pages, and the flat-batch
inputs of one pass over them.

Draft KV is the first thing given back: for requests that stop running (`retain`), and all of it
whenever the target's scheduler runs short of blocks (`release`), before any kept sequence or
running request; and blocks are taken only while `reserve` stay free for the target."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

import torch

from treeserve.engine.block_pool import KVBlock
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.request import Request
from treeserve.engine.spec_decode.step_costs import PassCosts
from treeserve.model.transfer import to_device

# positions one request feeds a drafter in one proposal (a longer backlog, a prompt's: in chunks, no draft yet)
MAX_CATCH_UP = 2048


@dataclass
class DraftSequence:
    """What a drafter keeps for one request: its KV blocks (subclasses add their own state)."""
    blocks: list[KVBlock] = field(default_factory=list)


S = TypeVar("S", bound=DraftSequence)


class DraftKV(Generic[S]):
    def __init__(self, space: KVSpace, owner: str, block_size: int, new_sequence: Callable[[], S]):
        self.pool, self.owner, self.block_size = space.pool, owner, block_size
        self.pool.add_owner(owner)
        self.new_sequence = new_sequence
        self.sequences: dict[str, S] = {}

    def sequence(self, request_id: str) -> S:
        sequence = self.sequences.get(request_id)
        if sequence is None:
            sequence = self.sequences[request_id] = self.new_sequence()
        return sequence

    def hold(self, sequence: S, num_tokens: int, reserve: int) -> bool:
        """Blocks for `num_tokens` positions, taken only while `reserve` blocks stay free."""
        needed = -(-num_tokens // self.block_size) - len(sequence.blocks)
        if needed <= 0:
            return True
        if self.pool.num_free - needed < reserve:
            return False
        sequence.blocks.extend(self.pool.allocate(needed, self.owner))
        return True

    def drop(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.pool.free(reversed(sequence.blocks))

    def retain(self, running: list[Request]) -> None:
        """The KV of requests no longer running goes back to the pool."""
        if self.sequences:
            live = {r.request_id for r in running}
            for request_id in [rid for rid in self.sequences if rid not in live]:
                self.drop(request_id)

    def release(self) -> bool:
        """Every block back to the pool; whether any was held."""
        held = bool(self.sequences)
        for request_id in list(self.sequences):
            self.drop(request_id)
        return held


class PassDrafter:
    """What a proposer with passes of its own shares: its KV (`kv`: given back for requests that
    stop running, and all of it when the scheduler runs short) and its passes' cost per draft
    token (`pass_costs`, from passes over single-token rows only)."""

    def __init__(self, kv: DraftKV):
        self.kv = kv
        self.pass_costs = PassCosts()

    @property
    def owner(self) -> str:
        return self.kv.owner

    @property
    def sequences(self) -> dict:
        return self.kv.sequences

    def retain(self, running: list[Request]) -> None:
        self.kv.retain(running)

    def release(self) -> bool:
        return self.kv.release()

    def verified(self, request: Request, num_accepted: int) -> None:
        """A step verified the request's drafts (before its computed tokens count them)."""


@dataclass
class PassInputs:
    positions: torch.Tensor
    meta: object
    last_rows: list[int]  # each chunk's last row, in the order the chunks were given


def pass_inputs(backend, rotary, block_size: int, device: torch.device,
                chunks: list[tuple[list[KVBlock], int, int, int]]) -> PassInputs:
    """The attention metadata and positions of one pass over `chunks` (blocks, first position,
    tokens, prompt length), single-token chunks first (as the attention metadata wants), then the
    rest; `last_rows` in the given order."""
    order = flat_order(chunks)
    builder = backend.metadata_builder(block_size, device)
    positions, slots, last_rows, num_rows = [], [], [0] * len(chunks), 0
    for i in order:
        blocks, first, count, num_prompt_tokens = chunks[i]
        context_len = first + count
        table = [b.block_id for b in blocks[:-(-context_len // block_size)]]
        pos = torch.arange(first, context_len, dtype=torch.long)
        positions.append(rotary.rope_positions(num_prompt_tokens, pos))
        slots.append(torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size)
        if count == 1:
            builder.add_decode(context_len, table)
        else:
            builder.add_prefill(num_rows, context_len, count, table)
        num_rows += count
        last_rows[i] = num_rows - 1
    meta = builder.build(to_device(torch.cat(slots), device))
    return PassInputs(to_device(torch.cat(positions), device), meta, last_rows)


def flat_order(chunks: list) -> list[int]:
    """The order `pass_inputs` lays the chunks' rows out in (callers lay out their tokens alike)."""
    return sorted(range(len(chunks)), key=lambda i: chunks[i][2] > 1)
