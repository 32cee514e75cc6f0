"""One served model's series, labelled with its name: written on the engine thread after each step and
each abort from the engine's stats and the step's outputs (see metrics.py for who reads them when)."""
from __future__ import annotations

import time

from treeserve.engine.engine_stats import EngineStats
from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import AbortedRequest, RequestOutput
from treeserve.server.metric_buckets import (ITERATION_BUCKETS, ITL_BUCKETS, MAX_TOKENS_BUCKET, N_BUCKETS,
                                             REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, one_two_five_buckets)
from treeserve.server.metric_series import Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self, server, model_name: str, max_model_len: int = MAX_TOKENS_BUCKET, draft_positions: int = 0):
        """`server` is the server's `ServerMetrics` (its families, made once and shared by the models, and
        its change count). The families are made in the order a scrape shows them."""
        self._server, self.model_name = server, model_name
        self._labels = {"model_name": model_name}
        self._add_scheduler_and_kv_gauges()
        self._add_prefix_cache_counters()
        self._add_spec_decode_counters(draft_positions)
        self._add_token_and_finish_counters()
        self._add_latency_histograms()
        self._add_request_size_histograms(max_model_len)
        self._add_memory_gauges()
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

    def _gauge(self, name: str, doc: str) -> Gauge:
        return self._server.family("gauge", name, doc).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return self._server.family("counter", name, doc).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = REQUEST_LATENCY_BUCKETS) -> Histogram:
        return self._server.family("histogram", name, doc, buckets=buckets).labels(**self._labels)

    def _add_scheduler_and_kv_gauges(self) -> None:
        self.running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = self._gauge("kv_cache_usage_perc",
                                    "Fraction of the KV pool's blocks this model holds (1 = full).")
        self.gpu_cache_usage = self._gauge("gpu_cache_usage_perc", "kv_cache_usage_perc's value under vLLM's older "
                                           "name (its Grafana dashboard's Cache Utilization panel).")
        self.kv_blocks_in_use = self._gauge("kv_blocks_in_use", "KV blocks (pages) this model's requests hold.")
        self.kv_blocks_free = self._gauge("kv_blocks_free",
                                          "Free KV blocks in the pool (shared pools: all models').")
        self.kv_blocks_wanted = self._gauge("kv_blocks_wanted", "Cached KV blocks this model's waiting requests "
                                            "will hit (evicted last).")

    def _add_prefix_cache_counters(self) -> None:
        self.prefix_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_evictions = self._counter("prefix_cache_evictions", "Cached KV blocks evicted for new data.")
        self.prefix_thrash = self._counter("prefix_cache_thrash", "Evicted block hashes that were requested again.")
        self.thrash_window = self._gauge("prefix_cache_thrash_window", "Evicted block hashes the thrash detector "
                                         "remembers (bounded: a few times the pool's blocks).")
        self.preemptions = self._counter("num_preemptions", "Requests preempted (to be recomputed).")

    def _add_spec_decode_counters(self, draft_positions: int) -> None:
        self.spec_drafts = self._counter("spec_decode_num_drafts",
                                         "Speculative drafts verified (one per request and step).")
        self.spec_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_accepted = self._counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self.spec_accepted_per_pos = self._server.family(
            "counter", "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by position in the draft.")
        for position in range(draft_positions):  # at 0 from the start, as vLLM's (its num_speculative_tokens)
            self.spec_accepted_per_pos.labels(**self._labels, position=str(position))

    def _add_token_and_finish_counters(self) -> None:
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests whose prefill is done.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.")
        self.request_success = self._server.family("counter", "request_success",
                                                   "Finished requests by finish reason.")
        for reason in ("stop", "length", "abort"):  # at 0 from the start, as vLLM's: a series that appears at 1
            self._success(reason)                     # loses its first event to rate() and increase()

    def _add_latency_histograms(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                   ITL_BUCKETS)
        # (the same numbers under a second name: observed once, on the engine thread, shown twice)
        self.tpot = self._server.family("histogram", "time_per_output_token_seconds", "inter_token_latency_seconds' "
                                        "observations under vLLM's older name (its Grafana dashboard's Time Per "
                                        "Output Token panel).", buckets=ITL_BUCKETS).mirror(self.itl, **self._labels)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Time from arrival to the end of the request.")
        self.queue_time = self._histogram("request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.prefill_time = self._histogram("request_prefill_time_seconds",
                                            "Time from first scheduling to first token.")
        self.decode_time = self._histogram("request_decode_time_seconds", "Time from first token to the end.")
        self.inference_time = self._histogram("request_inference_time_seconds", "Time from first scheduling to the "
                                              "end (prefill + decode).")
        self.request_tpot = self._histogram("request_time_per_output_token_seconds", "Each finished request's "
                                            "decode time over its longest sample's tokens after the first.",
                                            ITL_BUCKETS)
        self.iteration_tokens = self._histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                                ITERATION_BUCKETS)

    def _add_request_size_histograms(self, max_model_len: int) -> None:
        lengths = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                                     lengths)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens per finished request (all its samples).", lengths)
        self.request_max_generation_tokens = self._histogram(
            "request_max_num_generation_tokens", "Generated tokens of the longest sample of each finished request.",
            lengths)
        self.prefill_kv_computed = self._histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens each finished request computed (not found cached).",
            lengths)
        self.params_n = self._histogram("request_params_n", "The n parameter of each finished request.", N_BUCKETS)
        self.params_max_tokens = self._histogram("request_params_max_tokens", "The max_tokens parameter of each "
                                                 "finished request (the room left when not given).", lengths)

    def _add_memory_gauges(self) -> None:
        self.memory = {part: self._gauge(f"memory_{part}_bytes", f"Memory accounting: {part.replace('_', ' ')} bytes.")
                       for part in ("weights", "activation", "non_torch", "kv")}

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
