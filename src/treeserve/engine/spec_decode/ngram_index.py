"""An index of the n-grams of some token sequences: for each n-gram, where its latest occurrence
was followed (the sequence and the position after it). Sequences are indexed as they grow; a
lookup takes the longest n-gram ending a sequence that occurred before, and the tokens after it
are the draft. Where that occurrence is in the sequence itself, p tokens back, the text since is
taken to repeat with period p (a loop, a list's pattern): the draft runs k tokens, not just p."""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._latest: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self._indexed: dict[int, tuple[list[int], int]] = {}  # id(sequence) -> (sequence, continuations indexed up to)

    def __len__(self) -> int:
        return len(self._latest)

    def clear(self) -> None:
        self._latest.clear()
        self._indexed.clear()

    def extend(self, tokens: list[int], start: int = 1) -> None:
        """Indexes each n-gram of `tokens` that a token follows, at continuation positions from
        `start` (or from where the last call for this list stopped) to the end. The list is held,
        not copied: it may keep growing."""
        held = self._indexed.get(id(tokens))
        begin = max(start, held[1] if held is not None and held[0] is tokens else 0, 1)
        latest, min_n, max_n = self._latest, self.min_n, self.max_n
        for end in range(begin, len(tokens)):  # the n-grams ending just before `end`, followed by tokens[end]
            for n in range(min_n, min(max_n, end) + 1):
                latest[tuple(tokens[end - n:end])] = (tokens, end)
        self._indexed[id(tokens)] = (tokens, max(begin, len(tokens)))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
        ending `tokens` ([] when none occurred)."""
        return self.match(tokens, k)[1]

    def match(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(the length of the longest n-gram ending `tokens` found, the up to `k` tokens after its
        latest occurrence); (0, []) when none occurred."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._latest.get(tuple(tokens[-n:]))
            if hit is not None:
                sequence, end = hit
                if sequence is tokens and end + k > len(tokens):  # a repeat within the sequence: it goes on
                    period = len(tokens) - end
                    return n, [tokens[end + j % period] for j in range(k)]
                return n, sequence[end:end + k]
        return 0, []
