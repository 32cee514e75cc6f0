"""Search and scoring metrics, read from the runners and scorers when /metrics is scraped.

Counts live where the work happens (`SearchRunner`, `StepScorer`, kept KV), kept up to date as plain
integers; a scrape reads them (a few dozen attribute reads, safe from the HTTP thread), so the
engine thread pays nothing per step for them, and a scrape right after a search shows it. Only the
tree-size histogram is written on the engine thread, when a problem finishes.
"""
from __future__ import annotations

TREE_SIZE_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class SearchMetrics:
    def __init__(self, metrics, searches: dict, scorers: dict):
        """`metrics` is the server's `ServerMetrics`; `searches` maps a generator's name to its
        SearchServing, `scorers` a reward model's name to its StepScorer."""
        self._metrics = metrics
        self.tree_size = metrics.family("histogram", "search_tree_size", "Steps generated per finished search problem.",
                                        buckets=TREE_SIZE_BUCKETS)
        for name, serving in searches.items():
            serving.runner.finished_observers.append(self._observer(name))
        runners = {name: serving.runner for name, serving in searches.items()}
        self._reads = []  # (a series, how to read its value, what from)
        for table, sources in ((RUNNER_SERIES, runners), (SCORER_SERIES, scorers)):
            for kind, name, doc, read in table:  # counters: the sources' own totals, with no `_created`
                family = metrics.family(kind, name, doc, created=False)
                self._reads += [(family.labels(model_name=model), read, source) for model, source in sources.items()]

    def _observer(self, name: str):
        histogram = self.tree_size.labels(model_name=name)

        def observe(handle) -> None:  # on the engine thread
            if handle.result is not None:
                histogram.observe(handle.result.tree_size)
                self._metrics.changed()
        return observe

    def read(self) -> tuple:
        """Copies the current counts into their series (on a scrape); returns them."""
        values = tuple(read(source) for _, read, source in self._reads)
        for (series, _, _), value in zip(self._reads, values):
            series.value = value
        return values


# (kind, name, help, how to read it off a SearchRunner / a StepScorer)
RUNNER_SERIES = [
    ("gauge", "search_problems_running", "Search problems in flight (all requests together).", lambda r: r.num_running),
    ("gauge", "search_problems_waiting", "Search problems queued behind the in-flight bound.", lambda r: r.num_waiting),
    ("counter", "search_problems_finished", "Search problems finished.", lambda r: r.num_finished),
    ("counter", "search_problems_cancelled", "Search problems cancelled before their end (the client left).",
     lambda r: r.num_cancelled),
]
SCORER_SERIES = [
    ("counter", "search_score_cache_hits", "Scoring items answered without a verifier request of their own.",
     lambda s: s.num_cache_hits),
    ("counter", "search_verifier_tokens", "Tokens of every verifier input submitted (computed or reused).",
     lambda s: s.num_prompt_tokens),
    ("counter", "search_verifier_tokens_reused", "Verifier input tokens found in kept KV or the prefix cache.",
     lambda s: s.num_reused_tokens),
    ("gauge", "score_cache_entries", "Step scores held in the score cache.", lambda s: len(s.score_cache)),
    ("gauge", "score_cache_bytes", "Estimated bytes of the score cache (bounded; LRU eviction).",
     lambda s: s.score_cache.nbytes),
    ("gauge", "kv_blocks_kept", "KV blocks the scorer keeps on purpose for extensions (released under pressure).",
     lambda s: s.engine.stats().kept_blocks),
]
