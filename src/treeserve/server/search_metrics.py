"""Search and scoring metrics, read from the runners and scorers when /metrics is scraped.

Counts live where the work happens (`SearchRunner`, `StepScorer`, kept KV); this collector only
reads them, so the engine thread pays nothing per step for them.
"""
from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TREE_SIZE_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class SearchCollector:
    def __init__(self, searches: dict, scorers: dict, registry):
        self.searches = searches  # generator name -> SearchServing
        self.scorers = scorers    # reward model name -> StepScorer
        self.tree_size = Histogram("treeserve:search_tree_size", "Steps generated per finished search problem.",
                                   ["model_name"], buckets=TREE_SIZE_BUCKETS, registry=registry)
        for name, serving in searches.items():
            serving.runner.finished_observers.append(self._observer(name))
        registry.register(self)

    def _observer(self, name: str):
        histogram = self.tree_size.labels(model_name=name)

        def observe(handle) -> None:
            if handle.result is not None:
                histogram.observe(handle.result.tree_size)
        return observe

    def collect(self):
        runners = {name: s.runner for name, s in self.searches.items()}
        for kind, name, doc, read in RUNNER_SERIES:
            yield _family(kind, name, doc, {model: read(r) for model, r in runners.items()})
        for kind, name, doc, read in SCORER_SERIES:
            yield _family(kind, name, doc, {model: read(s) for model, s in self.scorers.items()})


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
     lambda s: s.engine.retained.num_blocks()),
]


def _family(kind: str, name: str, doc: str, values: dict):
    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    family = cls(f"treeserve:{name}", doc, labels=["model_name"])
    for model, value in values.items():
        family.add_metric([model], value)
    return family
