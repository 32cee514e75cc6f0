"""`suffix` drafting: how often each token followed each n-gram (of min_n to max_n tokens) in
some sequences, counted as they grow. A draft walks the most frequent continuation of the longest
n-gram ending the sequence, token by token, while the product of the continuations' frequencies
stays at or above a floor (Arctic's suffix decoding scores its suffix-tree paths the same way, and
vLLM's `suffix` method stops at `suffix_decoding_min_token_prob`)."""
from __future__ import annotations

from treeserve.engine.spec_decode.growing_index import GrowingIndex

MIN_PATH_PROBABILITY = 0.1


class ContinuationCounts(GrowingIndex):
    """Per n-gram, how often each token followed it."""

    def _take(self, tokens: list[int], end: int, keys: list[tuple[int, ...]]) -> None:
        token, table = tokens[end], self.table
        for key in keys:
            counts = table.get(key)
            if counts is None:
                table[key] = {token: 1}
            else:
                counts[token] = counts.get(token, 0) + 1


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
        found = [t.table[key] for t in tables if key in t.table]
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
