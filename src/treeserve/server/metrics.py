"""Prometheus metrics with vLLM's names under the `treeserve:` prefix (see docs/METRICS.md)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from treeserve.engine.block_pool import PrefixCacheStats
from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import RequestOutput
from treeserve.server.search_metrics import SearchCollector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    """One Prometheus registry; each served model gets its labelled `EngineMetrics`."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._families: dict[str, object] = {}
        self.by_engine: dict[int, EngineMetrics] = {}

    def family(self, kind, name: str, doc: str, labels: list[str], **kwargs):
        if name not in self._families:
            self._families[name] = kind(f"treeserve:{name}", doc, labels, registry=self.registry, **kwargs)
        return self._families[name]

    def add_model(self, engine: LLMEngine, model_name: str) -> "EngineMetrics":
        metrics = EngineMetrics(self, model_name)
        self.by_engine[id(engine)] = metrics
        return metrics

    def add_search(self, searches: dict, scorers: dict) -> None:
        """Search metrics for each served generator's runner and each reward model's scorer."""
        self.search = SearchCollector(searches, scorers, self.registry)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        self.by_engine[id(engine)].on_step(engine, outputs)

    def on_abort(self, engine: LLMEngine, request_id: str) -> None:
        self.by_engine[id(engine)].on_abort(engine, request_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    def __init__(self, server: ServerMetrics, model_name: str):
        labels = {"model_name": model_name}
        self._labels = labels
        names = ["model_name"]

        def gauge(name, doc):
            return server.family(Gauge, name, doc, names).labels(**labels)

        def counter(name, doc):
            return server.family(Counter, name, doc, names).labels(**labels)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return server.family(Histogram, name, doc, names, buckets=buckets).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV pool's blocks this model holds (1 = full).")
        self.kv_blocks_in_use = gauge("kv_blocks_in_use", "KV blocks (pages) this model's requests hold.")
        self.kv_blocks_free = gauge("kv_blocks_free", "Free KV blocks in the pool (shared pools: all models').")
        self.kv_blocks_wanted = gauge("kv_blocks_wanted", "Cached KV blocks this model's waiting requests "
                                      "will hit (evicted last).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_evictions = counter("prefix_cache_evictions", "Cached KV blocks evicted for new data.")
        self.prefix_thrash = counter("prefix_cache_thrash", "Evicted block hashes that were requested again.")
        self.thrash_window = gauge("prefix_cache_thrash_window", "Evicted block hashes the thrash detector "
                                   "remembers (bounded: a few times the pool's blocks).")
        self.preemptions = counter("num_preemptions", "Requests preempted (to be recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = server.family(Counter, "request_success", "Finished requests by finish reason.",
                                             names + ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the end of the request.")
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduling to first token.")
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to the end.")
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_BUCKETS)
        self.memory = {part: gauge(f"memory_{part}_bytes", f"Memory accounting: {part.replace('_', ' ')} bytes.")
                       for part in ("weights", "activation", "non_torch", "kv")}
        self._seen_tokens: dict[str, tuple[int, float]] = {}
        self._last_stats = PrefixCacheStats()
        self._last_preemptions = 0

    def set_memory(self, row) -> None:
        for part, gauge in self.memory.items():
            gauge.set(getattr(row, f"{part}_bytes"))

    def add_search(self, searches: dict, scorers: dict) -> None:
        """Search metrics for each served generator's runner and each reward model's scorer."""
        self.search = SearchCollector(searches, scorers, self.registry)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after every step."""
        now = time.monotonic()
        self._update_gauges(engine)
        self.iteration_tokens.observe(engine.last_step_num_tokens)
        for output in outputs:
            self._observe_tokens(output, now)
            if output.finished:
                self._observe_finished(output)

    def on_abort(self, engine: LLMEngine, request_id: str) -> None:
        self._update_gauges(engine)
        self._seen_tokens.pop(request_id, None)
        self.request_success.labels(**self._labels, finished_reason="abort").inc()

    def _update_gauges(self, engine: LLMEngine) -> None:
        scheduler, pool = engine.scheduler, engine.kv.pool
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        in_use = engine.kv.num_blocks_in_use()
        self.kv_usage.set(in_use / pool.num_blocks)
        self.kv_blocks_in_use.set(in_use)
        self.kv_blocks_free.set(pool.num_free)
        self.kv_blocks_wanted.set(pool.num_wanted_by(engine.kv.owner))
        self.thrash_window.set(pool.thrash_window_size)
        stats, last = engine.kv.stats.snapshot(), self._last_stats
        self.prefix_queries.inc(stats.queries - last.queries)
        self.prefix_hits.inc(stats.hits - last.hits)
        self.prefix_evictions.inc(stats.evictions - last.evictions)
        self.prefix_thrash.inc(stats.thrash - last.thrash)
        self._last_stats = stats
        self.preemptions.inc(scheduler.num_preemptions - self._last_preemptions)
        self._last_preemptions = scheduler.num_preemptions

    def _observe_tokens(self, output: RequestOutput, now: float) -> None:
        total = sum(len(c.token_ids) for c in output.outputs)
        seen, last_time = self._seen_tokens.get(output.request_id, (0, 0.0))
        new = total - seen
        if new <= 0:
            return
        self.generation_tokens.inc(new)
        if seen == 0:  # the engine's own first-token time: a final-only request (search) shows tokens at its end
            first = output.metrics.first_token_time
            self.ttft.observe((now if first is None else first) - output.metrics.arrival_time)
        else:
            for _ in range(new):
                self.itl.observe((now - last_time) / new)
        self._seen_tokens[output.request_id] = (total, now)

    def _observe_finished(self, output: RequestOutput) -> None:
        self._seen_tokens.pop(output.request_id, None)
        m = output.metrics
        end = m.finished_time or time.monotonic()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.request_success.labels(**self._labels, finished_reason=completion.finish_reason or "abort").inc()
        self.e2e.observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                self.decode_time.observe(end - m.first_token_time)
