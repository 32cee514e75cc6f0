"""`suffix` drafting: how often each token followed each n-gram (of min_n to max_n tokens) in
some sequences, counted as they grow. A draft walks the most frequent continuation of the longest
n-gram ending the sequence, token by token, while the product of the continuations' frequencies
stays at or above a floor (Arctic's suffix decoding scores its suffix-tree paths the same way, and
vLLM's `suffix` method stops at `suffix_decoding_min_token_prob`)."""
from __future__ import annotations

MIN_PATH_PROBABILITY = 0.1


class ContinuationCounts:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.next: dict[tuple[int, ...], dict[int, int]] = {}
        self._indexed: dict[int, tuple[list[int], int]] = {}  # id(sequence) -> (sequence, counted up to)

    def __len__(self) -> int:
        return len(self.next)

    def clear(self) -> None:
        self.next.clear()
        self._indexed.clear()

    def extend(self, tokens: list[int], start: int = 1) -> None:
        """Counts each token of `tokens` from `start` (or from where the last call for this list
        stopped) after the n-grams before it. The list is held: it may keep growing."""
        held = self._indexed.get(id(tokens))
        begin = max(start, held[1] if held is not None and held[0] is tokens else 0, 1)
        counted, min_n, max_n = self.next, self.min_n, self.max_n
        for end in range(begin, len(tokens)):
            token = tokens[end]
            for n in range(min_n, min(max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                counts = counted.get(key)
                if counts is None:
                    counted[key] = {token: 1}
                else:
                    counts[token] = counts.get(token, 0) + 1
        self._indexed[id(tokens)] = (tokens, max(begin, len(tokens)))


def draft(tables: list[ContinuationCounts], tokens: list[int], k: int,
          min_path: float = MIN_PATH_PROBABILITY) -> list[int]:
    """Up to `k` tokens: at each, the longest n-gram ending the text so far that any table has,
    its counts summed over the tables that have it, the most frequent next token taken while the
    path's probability stays at least `min_path`."""
    if not tables:
        return []
    min_n, max_n = tables[0].min_n, tables[0].max_n
    context = list(tokens[-max_n:])
    out: list[int] = []
    path = 1.0
    while len(out) < k:
        counts = _longest(tables, context, min_n, max_n)
        if counts is None:
            break
        token, count = max(counts.items(), key=lambda item: item[1])
        path *= count / sum(counts.values())
        if path < min_path:
            break
        out.append(token)
        context.append(token)
        del context[0]
    return out


def _longest(tables, context, min_n, max_n) -> dict[int, int] | None:
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        key = tuple(context[-n:])
        found = [t.next[key] for t in tables if key in t.next]
        if not found:
            continue
        if len(found) == 1:
            return found[0]
        merged: dict[int, int] = {}
        for counts in found:
            for token, count in counts.items():
                merged[token] = merged.get(token, 0) + count
        return merged
    return None
