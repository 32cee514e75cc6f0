"""Host time of `bad_words` masking in one verification: 64 requests x (8 drafts + 1) rows, each
request with OUTPUT tokens of output and 4 bad words (2-3 tokens), `apply_token_masks` over the rows'
views (engine/spec_decode/draft_rows.py), median of 200. Run it under another checkout's `src`
(PYTHONPATH) for the time before a change.

    python benchmarks/bad_words_verification.py [OUTPUT ...]   (default: 200 2000)
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from treeserve import SamplingParams
from treeserve.engine.input_batch import CachedRequestState
from treeserve.engine.spec_decode.draft_rows import draft_rows
from treeserve.engine.token_masks import apply_token_masks

BAD_WORDS = ((5, 6), (7, 8, 9), (11, 12), (13, 14, 15))
DRAFTS = [5, 6, 7, 8, 9, 11, 12, 13]


def state(index: int, output_tokens: int) -> CachedRequestState:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens + 100)
    params.bad_words_token_ids = BAD_WORDS
    tokens = list(range(100)) + [(index + j) % 1000 for j in range(output_tokens)]
    return CachedRequestState(f"r{index}", tokens, 100, [], len(tokens) - 1, params, (0,), False, None, None, None)


def measure(output_tokens: int) -> float:
    views = draft_rows([(state(i, output_tokens), DRAFTS) for i in range(64)])
    logits = torch.zeros(len(views), 1024)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        apply_token_masks(logits, views)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    for output_tokens in [int(a) for a in sys.argv[1:]] or [200, 2000]:
        print(f"output {output_tokens} tokens, 576 rows: {measure(output_tokens) * 1e3:.3f} ms a verification")
