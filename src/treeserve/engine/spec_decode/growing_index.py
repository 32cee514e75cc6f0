"""What followed each n-gram (of min_n to max_n tokens) in some token sequences, taken in as the
sequences grow: the lists are held, not copied, and each `extend` takes in only the positions
added since the last call for that list. What is kept per n-gram is the subclass's (`_take`)."""
from __future__ import annotations

import abc


class GrowingIndex(abc.ABC):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], object] = {}
        self._indexed: dict[int, tuple[list[int], int]] = {}  # id(sequence) -> (sequence, taken in up to)

    def __len__(self) -> int:
        return len(self.table)

    def clear(self) -> None:
        self.table.clear()
        self._indexed.clear()

    def extend(self, tokens: list[int], start: int = 1) -> None:
        """Takes in each token of `tokens` from `start` (or from where the last call for this list
        stopped) with the n-grams ending just before it."""
        held = self._indexed.get(id(tokens))
        begin = max(start, held[1] if held is not None and held[0] is tokens else 0, 1)
        min_n, max_n = self.min_n, self.max_n
        for end in range(begin, len(tokens)):
            self._take(tokens, end, [tuple(tokens[end - n:end]) for n in range(min_n, min(max_n, end) + 1)])
        self._indexed[id(tokens)] = (tokens, max(begin, len(tokens)))

    @abc.abstractmethod
    def _take(self, tokens: list[int], end: int, keys: list[tuple[int, ...]]) -> None:
        """`tokens[end]` followed each n-gram of `keys`."""
