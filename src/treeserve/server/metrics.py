"""Prometheus metrics with vLLM's names under the `treeserve:` prefix (see docs/METRICS.md).

Who does what, and where. The engine thread writes every engine-side value after each step and each
abort (`on_step`, `on_abort`) into plain numbers: no lock, and no engine object is read later. A
scrape, on the HTTP event loop, formats those numbers (and reads the search runners' counters, see
search_metrics.py); it never runs on the engine thread, never waits for it, and holds the GIL
briefly: each series' text up to its value (`name{labels} `) is built once when the series is made,
so a render formats one number per line (0.1-0.2 ms of CPU for two served models' ~980 lines, where
prometheus_client's `generate_latest` re-escaped every label of every line: 3-5 ms of CPU idle, 11-13
ms under load, all holding the GIL that the engine thread needs between its ops). A histogram with no
new observation reuses its text, and a scrape that finds nothing changed since the last render is
served the same bytes. The text is prometheus_client's exposition, byte for byte.

Where: the series and their families in metric_series.py, each served model's in engine_metrics.py
(bucket bounds in metric_buckets.py), the search runners' and scorers' in search_metrics.py; this
module holds the families and renders them.
"""
from __future__ import annotations

from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import AbortedRequest, RequestOutput
from treeserve.server.engine_metrics import EngineMetrics
from treeserve.server.metric_buckets import MAX_TOKENS_BUCKET
from treeserve.server.metric_series import Family
from treeserve.server.search_metrics import SearchMetrics


class ServerMetrics:
    """Every family of the server; each served model gets its labelled `EngineMetrics`."""

    def __init__(self):
        self._families: dict[str, Family] = {}
        self.by_engine: dict[int, EngineMetrics] = {}
        self.search = None
        self.version = 0  # bumped by the engine thread after its writes: the render cache's key
        self._rendered: tuple[object, bytes] = (None, b"")

    def family(self, kind: str, name: str, doc: str, **options) -> Family:
        if name not in self._families:
            self._families[name] = Family(kind, name, doc, **options)
        return self._families[name]

    def add_model(self, engine: LLMEngine, model_name: str) -> EngineMetrics:
        metrics = EngineMetrics(self, model_name, getattr(engine, "max_model_len", None) or MAX_TOKENS_BUCKET,
                                _draft_positions(engine))
        self.by_engine[id(engine)] = metrics
        return metrics

    def add_search(self, searches: dict, scorers: dict) -> None:
        """Search metrics for each served generator's runner and each reward model's scorer."""
        self.search = SearchMetrics(self, searches, scorers)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        self.by_engine[id(engine)].on_step(engine, outputs)
        self.version += 1

    def on_abort(self, engine: LLMEngine, aborted: AbortedRequest) -> None:
        self.by_engine[id(engine)].on_abort(engine, aborted)
        self.version += 1

    def on_idle(self, engine: LLMEngine) -> None:
        """Called on the engine thread for an engine that did not step: its gauges made current."""
        if self.by_engine[id(engine)].refresh_gauges(engine):
            self.version += 1

    def changed(self) -> None:
        """Called after a write outside a step (memory rows, a finished search's tree size)."""
        self.version += 1

    def render(self) -> bytes:
        """The text exposition. Called by a scrape; the same bytes while nothing changed."""
        key = (self.version, self.search.read() if self.search is not None else None)  # before the values
        if self._rendered[0] == key:
            return self._rendered[1]
        out: list[str] = []
        for family in list(self._families.values()):
            family.render(out)
        body = "".join(out).encode()
        self._rendered = (key, body)
        return body


def _draft_positions(engine) -> int:
    """The draft positions the engine's own speculative_config drafts (0: it does not speculate)."""
    speculative = getattr(getattr(engine, "config", None), "speculative_config", None)
    return getattr(speculative, "num_speculative_tokens", 0)
