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
"""
from __future__ import annotations

import os
import time
from bisect import bisect_left

from prometheus_client.utils import floatToGoString

from treeserve.engine.engine_stats import EngineStats
from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import AbortedRequest, RequestOutput
from treeserve.server.search_metrics import SearchMetrics

# Every bucket bound of vLLM's histogram of the same name (so a dashboard's `le` and quantiles read the
# same), with finer ones below where a fast server's values lie (vLLM's ITL starts at 10 ms, its
# request-phase times at 0.3 s)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
MAX_TOKENS_BUCKET = 1 << 17  # the token-count histograms' largest bound when the model's length is not known
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts, to max_model_len)."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10
# prometheus_client's switch for the `_created` series, honoured the same way
CREATED_SERIES = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")


# ---- series: plain numbers, written by one thread, formatted by a scrape -----------------------
def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _line_start(name: str, labels: dict[str, str]) -> str:
    """`name{labels} ` as the text format writes it (labels sorted by name), value to follow."""
    text = ",".join(f'{key}="{_escape(str(value))}"' for key, value in sorted(labels.items()))
    return f"{name}{{{text}}} " if text else f"{name} "


class Gauge:
    def __init__(self, name: str, labels: dict[str, str]):
        self.value = 0.0
        self._start = _line_start(name, labels)

    def set(self, value: float) -> None:
        self.value = value

    def render(self, out: list[str]) -> None:
        out.append(f"{self._start}{floatToGoString(self.value)}\n")


class Counter(Gauge):
    def __init__(self, name: str, labels: dict[str, str]):
        super().__init__(f"{name}_total", labels)
        self.created_line = f"{_line_start(f'{name}_created', labels)}{floatToGoString(time.time())}\n"

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up: inc({amount})")
        self.value += amount


class Histogram:
    """Bucket counts kept per bucket (cumulated when rendered); the sum is added before the bucket's
    count so that a render never shows a count whose observation is missing from the sum."""

    def __init__(self, name: str, labels: dict[str, str], buckets: tuple[float, ...]):
        self.upper_bounds = [float(b) for b in buckets] + [float("inf")]
        self.counts = [0] * len(self.upper_bounds)
        self.sum = 0.0
        self._bucket_starts = [_line_start(f"{name}_bucket", {**labels, "le": floatToGoString(b)})
                               for b in self.upper_bounds]
        self._count_start = _line_start(f"{name}_count", labels)
        self._sum_start = _line_start(f"{name}_sum", labels)
        self.created_line = f"{_line_start(f'{name}_created', labels)}{floatToGoString(time.time())}\n"
        self._text = ("", -1)  # the last render and its number of observations

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (as that many calls)."""
        self.sum += value * count
        self.counts[bisect_left(self.upper_bounds, value)] += count

    def render(self, out: list[str]) -> None:
        counts = list(self.counts)  # one copy: the engine thread may observe meanwhile
        total = sum(counts)
        if self._text[1] != total:  # no new observation: the same text (counts only grow)
            lines, running = [], 0
            for start, count in zip(self._bucket_starts, counts):
                running += count
                lines.append(f"{start}{floatToGoString(running)}\n")
            lines.append(f"{self._count_start}{floatToGoString(total)}\n")
            lines.append(f"{self._sum_start}{floatToGoString(self.sum)}\n")
            self._text = ("".join(lines), total)
        out.append(self._text[0])


class MirroredHistogram(Histogram):
    """Another histogram's observations under a second name (a deprecated alias vLLM still serves):
    its counts list is the source's own, its sum read from the source, so each value is observed once."""

    def __init__(self, name: str, labels: dict[str, str], source: Histogram):
        self._source = source
        super().__init__(name, labels, tuple(source.upper_bounds[:-1]))
        self.counts = source.counts

    @property
    def sum(self) -> float:
        return self._source.sum

    @sum.setter
    def sum(self, value: float) -> None:  # (Histogram.__init__'s 0.0; nothing observes a mirror)
        pass

    def observe(self, value: float, count: int = 1) -> None:
        raise TypeError("a mirrored histogram is observed through its source")


class Family:
    """One metric's HELP and TYPE and its labelled series, in the order they were made; counters and
    histograms are followed by their `_created` stamps, as prometheus_client writes them."""

    def __init__(self, kind: str, name: str, doc: str, buckets: tuple[float, ...] = (), created: bool = True):
        self.kind, self.name, self.buckets = kind, f"treeserve:{name}", buckets
        self.series: dict[tuple, Gauge | Counter | Histogram] = {}
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        shown = f"{self.name}_total" if kind == "counter" else self.name
        self._header = f"# HELP {shown} {doc}\n# TYPE {shown} {kind}\n"
        self._created_header = (f"# HELP {self.name}_created {doc}\n# TYPE {self.name}_created gauge\n"
                                if created and CREATED_SERIES and kind != "gauge" else None)

    def labels(self, **labels: str):
        key = tuple(sorted(labels.items()))
        series = self.series.get(key)
        if series is None:  # (a new finish reason: on the engine thread; a render iterates over a copy)
            if self.kind == "histogram":
                series = Histogram(self.name, labels, self.buckets)
            else:
                series = (Counter if self.kind == "counter" else Gauge)(self.name, labels)
            self.series[key] = series
        return series

    def mirror(self, source: Histogram, **labels: str) -> MirroredHistogram:
        """A series of this family showing `source`'s observations."""
        series = self.series[tuple(sorted(labels.items()))] = MirroredHistogram(self.name, labels, source)
        return series

    def render(self, out: list[str]) -> None:
        series = list(self.series.values())
        out.append(self._header)
        for one in series:
            one.render(out)
        if self._created_header is not None and series:
            out.append(self._created_header)
            out.extend(one.created_line for one in series)


# ---- the server's metrics ----------------------------------------------------------------------
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

    def add_model(self, engine: LLMEngine, model_name: str) -> "EngineMetrics":
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


class EngineMetrics:
    def __init__(self, server: ServerMetrics, model_name: str, max_model_len: int = MAX_TOKENS_BUCKET,
                 draft_positions: int = 0):
        self._server, self.model_name = server, model_name
        self._labels = labels = {"model_name": model_name}

        def gauge(name, doc):
            return server.family("gauge", name, doc).labels(**labels)

        def counter(name, doc):
            return server.family("counter", name, doc).labels(**labels)

        def histogram(name, doc, buckets=REQUEST_LATENCY_BUCKETS):
            return server.family("histogram", name, doc, buckets=buckets).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV pool's blocks this model holds (1 = full).")
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "kv_cache_usage_perc's value under vLLM's older name "
                                     "(its Grafana dashboard's Cache Utilization panel).")
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
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified (one per request and step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self.spec_accepted_per_pos = server.family("counter", "spec_decode_num_accepted_tokens_per_pos",
                                                   "Speculative draft tokens accepted, by position in the draft.")
        for position in range(draft_positions):  # at 0 from the start, as vLLM's (its num_speculative_tokens)
            self.spec_accepted_per_pos.labels(**labels, position=str(position))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill is done.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = server.family("counter", "request_success", "Finished requests by finish reason.")
        for reason in ("stop", "length", "abort"):  # at 0 from the start, as vLLM's: a series that appears at 1
            self._success(reason)                     # loses its first event to rate() and increase()
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        # (the same numbers under a second name: observed once, on the engine thread, shown twice)
        self.tpot = server.family("histogram", "time_per_output_token_seconds", "inter_token_latency_seconds' "
                                  "observations under vLLM's older name (its Grafana dashboard's Time Per Output "
                                  "Token panel).", buckets=ITL_BUCKETS).mirror(self.itl, **labels)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the end of the request.")
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduling to first token.")
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to the end.")
        self.inference_time = histogram("request_inference_time_seconds", "Time from first scheduling to the end "
                                        "(prefill + decode).")
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Each finished request's decode "
                                      "time over its longest sample's tokens after the first.", ITL_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_BUCKETS)
        lengths = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.", lengths)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request (all its samples).", lengths)
        self.request_max_generation_tokens = histogram("request_max_num_generation_tokens", "Generated tokens of "
                                                       "the longest sample of each finished request.", lengths)
        self.prefill_kv_computed = histogram("request_prefill_kv_computed_tokens", "Prompt tokens each finished "
                                             "request computed (not found cached).", lengths)
        self.params_n = histogram("request_params_n", "The n parameter of each finished request.", N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens parameter of each "
                                           "finished request (the room left when not given).", lengths)
        self.memory = {part: gauge(f"memory_{part}_bytes", f"Memory accounting: {part.replace('_', ' ')} bytes.")
                       for part in ("weights", "activation", "non_torch", "kv")}
        self._seen_tokens: dict[str, tuple[int, float]] = {}
        # EngineStats' cumulative counters -> the Prometheus counters they advance
        self._counted = {"prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                         "evictions": self.prefix_evictions, "thrash": self.prefix_thrash,
                         "num_preemptions": self.preemptions, "spec_decode_num_drafts": self.spec_drafts,
                         "spec_decode_num_draft_tokens": self.spec_draft_tokens,
                         "spec_decode_num_accepted_tokens": self.spec_accepted,
                         "num_prompt_tokens": self.prompt_tokens, "num_generation_tokens": self.generation_tokens}
        self._last_counts = dict.fromkeys(self._counted, 0)
        self._from_stats = [self.running, self.waiting, self.kv_usage, self.kv_blocks_in_use, self.kv_blocks_free,
                            self.kv_blocks_wanted, self.thrash_window, *self._counted.values()]
        self._last_per_pos: tuple[int, ...] = ()
        self._last_num_steps = 0  # the engine's steps that ran the model, as last seen

    def set_memory(self, row) -> None:
        for part, gauge in self.memory.items():
            gauge.set(getattr(row, f"{part}_bytes"))
        self._server.changed()

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after every step."""
        now = time.monotonic()
        stats = self._update_gauges(engine)
        if stats.num_steps != self._last_num_steps:  # (not a step that only landed an earlier one's results)
            self._last_num_steps = stats.num_steps
            self.iteration_tokens.observe(stats.last_step_num_tokens)
        for output in outputs:
            self._observe_tokens(output, now)
            self._count_finishes(output)
            if output.finished:
                self._observe_finished(output)

    def on_abort(self, engine: LLMEngine, aborted: AbortedRequest) -> None:
        """Each sample's finish that no output reported, as vLLM counts it (cut ones as `abort`); its
        prompt and tokens were counted as the engine computed them."""
        self._update_gauges(engine)
        self._seen_tokens.pop(aborted.request_id, None)
        for _, reason in aborted.samples:
            if reason is None or not aborted.delta:  # a delta output reported a finished sample's own finish
                self._success(reason or "abort").inc()

    def refresh_gauges(self, engine: LLMEngine) -> bool:
        """The gauges and counters read from the engine's stats again; whether any moved."""
        before = [series.value for series in self._from_stats]
        self._update_gauges(engine)
        return any(series.value != value for series, value in zip(self._from_stats, before))

    def _success(self, reason: str) -> Counter:
        return self.request_success.labels(**self._labels, finished_reason=reason)

    def _update_gauges(self, engine: LLMEngine) -> EngineStats:
        stats = engine.stats()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.gpu_cache_usage.set(stats.kv_usage)
        self.kv_blocks_in_use.set(stats.kv_blocks_in_use)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        self.kv_blocks_wanted.set(stats.kv_blocks_wanted)
        self.thrash_window.set(stats.thrash_window_size)
        for name, counter in self._counted.items():
            value = getattr(stats, name)
            counter.inc(value - self._last_counts[name])
            self._last_counts[name] = value
        self._count_accepted_per_position(stats.spec_decode_num_accepted_tokens_per_pos)
        return stats

    def _count_accepted_per_position(self, counts: tuple[int, ...]) -> None:
        if counts == self._last_per_pos:
            return
        last = self._last_per_pos + (0,) * (len(counts) - len(self._last_per_pos))
        for position, (value, before) in enumerate(zip(counts, last)):
            if value > before:
                self.spec_accepted_per_pos.labels(**self._labels, position=str(position)).inc(value - before)
        self._last_per_pos = counts

    def _observe_tokens(self, output: RequestOutput, now: float) -> None:
        seen, last_time = self._seen_tokens.get(output.request_id, (0, 0.0))
        total = samples = 0
        for completion in output.outputs:
            if completion.token_ids:
                total, samples = total + len(completion.token_ids), samples + 1
        total += seen if output.delta else 0
        new = total - seen
        if new <= 0:
            return
        if seen == 0:  # the engine's own first-token time: a final-only request shows its tokens at its end
            first = output.metrics.first_token_time
            self.ttft.observe((now if first is None else first) - output.metrics.arrival_time)
            if output.finished:
                self._observe_mean_itl(output)
        else:
            # each sample that advanced waited the whole gap (its n samples step together; vLLM runs them
            # as n requests), its tokens sharing it; a whole output's samples that had ended are not
            # among the `new` tokens' samples
            self.itl.observe((now - last_time) * min(samples, new) / new, new)
        self._seen_tokens[output.request_id] = (total, now)

    def _observe_mean_itl(self, output: RequestOutput) -> None:
        """A request whose tokens all came in its one output (final-only: a non-streamed request, a
        search's): each sample's tokens after its first, at the mean gap of its longest sample (the
        one whose decode spans the request's; the samples step together)."""
        lengths = [len(c.token_ids) for c in output.outputs]
        longest, m = max(lengths, default=0), output.metrics
        if longest <= 1 or m.first_token_time is None or m.finished_time is None:
            return
        gaps = sum(length - 1 for length in lengths if length)
        self.itl.observe(max(m.finished_time - m.first_token_time, 0.0) / (longest - 1), gaps)

    @staticmethod
    def _longest_sample(output: RequestOutput) -> int:
        """Its longest sample's tokens: a delta output's last holds only what changed, so the engine's
        count (kept for it at no per-step cost here, on the engine thread)."""
        if output.delta:
            return output.metrics.longest_sample
        return max((len(c.token_ids) for c in output.outputs), default=0)

    def _count_finishes(self, output: RequestOutput) -> None:
        """Each completion's finish, once: as each delta reports it (the samples of a delta request
        end on different steps and its last output holds only what changed), else at the end."""
        if output.delta:
            for completion in output.outputs:
                if completion.finish_reason is not None:
                    self._success(completion.finish_reason).inc()
        elif output.finished:
            for completion in output.outputs:
                self._success(completion.finish_reason or "abort").inc()

    def _observe_finished(self, output: RequestOutput) -> None:
        """Once per request (vLLM observes these per sample, its n samples being n requests; n and the
        longest sample, as here, per request)."""
        longest = self._longest_sample(output)
        generated, _ = self._seen_tokens.pop(output.request_id, (0, 0.0))  # (its outputs were counted first)
        m = output.metrics
        end = m.finished_time or time.monotonic()
        num_prompt = len(output.prompt_token_ids)
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(generated)
        self.request_max_generation_tokens.observe(longest)
        self.prefill_kv_computed.observe(max(num_prompt - output.num_cached_tokens, 0))
        self.params_n.observe(m.n)
        if m.max_tokens:  # (as vLLM: a request without the parameter, here a prefill-only one, is not observed)
            self.params_max_tokens.observe(m.max_tokens)
        self.e2e.observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.inference_time.observe(end - m.first_scheduled_time)
            if m.first_token_time is not None:
                decode = end - m.first_token_time
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                self.decode_time.observe(decode)
                self.request_tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)

