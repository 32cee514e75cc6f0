"""The runner's block tables: each request's block ids kept as one row of a numpy int32 array, written
where they change (appended blocks, a copied-on-write tail), so that a step's tables are one
gather of rows (`rows`) rather than lists padded and converted per step (vLLM's `BlockTable`).
The array grows, in rows and in width, as requests and their tables do."""
from __future__ import annotations

import numpy as np

INITIAL_ROWS = 64
INITIAL_WIDTH = 64


class BlockTable:
    def __init__(self, rows: int = INITIAL_ROWS, width: int = INITIAL_WIDTH):
        self.table = np.zeros((rows, width), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))  # (popped from the end: lowest row first)

    @property
    def num_rows_in_use(self) -> int:
        return self.table.shape[0] - len(self._free_rows)

    def add(self, block_ids: list[int]) -> int:
        """A row for a new request's table; returns its index."""
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.write(row, 0, block_ids)
        return row

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """The row's entries from `start` on become `block_ids` (those past them are left as they were:
        a step reads a row only up to its sequence's length)."""
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow_width(end)
        if block_ids:
            self.table[row, start:end] = block_ids

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def rows(self, rows: list[int], width: int) -> np.ndarray:
        """The tables of `rows`, in that order, cut to their first `width` entries: [len(rows), width]."""
        return self.table[rows, :width]

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))

    def _grow_width(self, needed: int) -> None:
        width = self.table.shape[1]
        while width < needed:
            width *= 2
        grown = np.zeros((self.table.shape[0], width), dtype=np.int32)
        grown[:, :self.table.shape[1]] = self.table
        self.table = grown
