"""An index of the n-grams of some token sequences: for each n-gram, where its latest occurrence
was followed (the sequence and the position after it). Sequences are indexed as they grow; a
lookup takes the longest n-gram ending a sequence that occurred before, and the tokens after it
are the draft. Where that occurrence is in the sequence itself, p tokens back, the text since is
taken to repeat with period p (a loop, a list's pattern): the draft runs k tokens, not just p."""
from __future__ import annotations

from treeserve.engine.spec_decode.growing_index import GrowingIndex


class NgramIndex(GrowingIndex):
    """Per n-gram, the latest place it was followed: (the sequence, the position after it)."""

    def _take(self, tokens: list[int], end: int, keys: list[tuple[int, ...]]) -> None:
        latest = (tokens, end)
        for key in keys:
            self.table[key] = latest

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
        ending `tokens` ([] when none occurred)."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self.table.get(tuple(tokens[-n:]))
            if hit is not None:
                sequence, end = hit
                if sequence is tokens and end + k > len(tokens):  # a repeat within the sequence: it goes on
                    period = len(tokens) - end
                    return [tokens[end + j % period] for j in range(k)]
                return sequence[end:end + k]
        return []
