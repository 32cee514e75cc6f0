"""Metrics of a run, computed from the request log (definitions in docs/BENCHMARKS.md).

Times are seconds on the run's clock; reported latencies are milliseconds.
"""
from __future__ import annotations

import math

import numpy as np

from treeserve.bench.client import RequestRecord
from treeserve.errors import ParamError

PERCENTILES = (50, 90, 99)
OUTPUT_LEN_BINS = (("<=30", 0, 30), ("31-300", 31, 300), (">300", 301, math.inf))
SLO_METRICS = ("ttft", "tpot", "e2el")
SATURATION_FRACTION = 0.95
SERVER_COUNTERS = {"generation_tokens": "generation_tokens_total", "prompt_tokens": "prompt_tokens_total",
                   "requests_finished": "request_success_total", "prefix_cache_queries": "prefix_cache_queries_total",
                   "prefix_cache_hits": "prefix_cache_hits_total", "preemptions": "num_preemptions_total",
                   "queue_time_sum_s": "request_queue_time_seconds_sum",
                   "queue_time_count": "request_queue_time_seconds_count",
                   # speculative decoding (vLLM's names, treeserve's too)
                   "spec_drafts": "spec_decode_num_drafts_total",
                   "spec_draft_tokens": "spec_decode_num_draft_tokens_total",
                   "spec_accepted_tokens": "spec_decode_num_accepted_tokens_total"}


# ---- one request -------------------------------------------------------------------------------
def ttft(record: RequestRecord) -> float | None:
    """Send to the first chunk carrying text."""
    return None if record.first_token is None else record.first_token - record.start


def e2e_latency(record: RequestRecord) -> float | None:
    return None if record.end is None else record.end - record.start


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first: (e2e latency - TTFT) / (output tokens - 1)."""
    first = ttft(record)
    if first is None or not record.output_tokens:
        return None
    if record.output_tokens == 1:
        return 0.0
    return (e2e_latency(record) - first) / (record.output_tokens - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    """Gaps between consecutive text-carrying chunks."""
    times = record.chunk_times
    return [b - a for a, b in zip(times, times[1:])]


# ---- distributions -----------------------------------------------------------------------------
def distribution(values_s: list[float]) -> dict:
    """mean, median, p90, p99 (linear interpolation between order statistics) in milliseconds."""
    if not values_s:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, PERCENTILES)
    return {"count": len(ms), "mean": float(ms.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slos = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ParamError("goodput", f"'{spec}' names no metric; use {', '.join(SLO_METRICS)} as NAME:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ParamError("goodput", f"'{spec}' has no number of milliseconds after the colon") from None
        if slos[name] <= 0:
            raise ParamError("goodput", f"'{spec}' must be a positive number of milliseconds")
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Successful, and every SLO met; an SLO on a value the request lacks (TTFT without streaming) fails."""
    if not record.success:
        return False
    values = {"ttft": ttft(record), "tpot": tpot(record), "e2el": e2e_latency(record)}
    return all(values[name] is not None and values[name] * 1000.0 <= bound for name, bound in slos.items())


def output_len_bins(records: list[RequestRecord]) -> dict:
    """Per bin of output length: requests, and the mean of each request's output tokens / e2e latency."""
    bins = {}
    for name, low, high in OUTPUT_LEN_BINS:
        rates = [r.output_tokens / e2e_latency(r) for r in records
                 if r.success and r.output_tokens and low <= r.output_tokens <= high and e2e_latency(r) > 0]
        bins[name] = {"requests": len(rates), "mean_tokens_per_s": float(np.mean(rates)) if rates else None}
    return bins


# ---- a level -----------------------------------------------------------------------------------
def summarize(records: list[RequestRecord], slos: dict[str, float] | None = None,
              server: dict | None = None) -> dict:
    """Every figure for one load level; `server` is the change in the server's counters over it."""
    done = [r for r in records if r.success]
    duration = span(records)
    out_tokens = sum(r.output_tokens or 0 for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    summary = {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": per_second(len(done), duration),
        "output_throughput": per_second(out_tokens, duration),
        "total_token_throughput": per_second(in_tokens + out_tokens, duration),
        "ttft_ms": distribution([v for v in map(ttft, done) if v is not None]),
        "tpot_ms": distribution([v for r in done if (r.output_tokens or 0) > 1 and (v := tpot(r)) is not None]),
        "itl_ms": distribution([gap for r in done for gap in inter_token_latencies(r)]),
        "e2el_ms": distribution([e2e_latency(r) for r in done]),
        "output_len_bins": output_len_bins(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    if slos:
        summary["goodput"] = per_second(sum(meets_slos(r, slos) for r in records), duration)
        summary["slos_ms"] = dict(slos)
    if server:
        summary["server"] = server
        summary["queue_time_ms"] = server_queue_time_ms(server)
        if server.get("spec_draft_tokens"):
            summary["spec_decode"] = spec_decode_summary(server)
    per_request = request_acceptance(done)
    if per_request is not None:
        summary.setdefault("spec_decode", {})["request_acceptance_rate"] = per_request
    return summary


def request_acceptance(records: list[RequestRecord]) -> dict | None:
    """The distribution over requests of each one's share of draft tokens kept (requests the
    server drafted for and reported: usage.completion_tokens_details)."""
    rates = [r.accepted_draft_tokens / (r.accepted_draft_tokens + r.rejected_draft_tokens) for r in records
             if r.accepted_draft_tokens is not None and r.accepted_draft_tokens + (r.rejected_draft_tokens or 0)]
    if not rates:
        return None
    p10, p50, p90 = np.percentile(np.asarray(rates, dtype=float), (10, 50, 90))
    return {"count": len(rates), "mean": float(np.mean(rates)), "p10": float(p10), "median": float(p50),
            "p90": float(p90)}


def spec_decode_summary(server: dict) -> dict:
    """vLLM bench's speculation figures over the level: the share of draft tokens accepted, and the
    mean tokens a verified draft gave (its accepted tokens plus the one sampled after them)."""
    drafts, accepted = server.get("spec_drafts") or 0, server.get("spec_accepted_tokens") or 0
    return {"acceptance_rate": accepted / server["spec_draft_tokens"],
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "drafts": drafts, "draft_tokens": server["spec_draft_tokens"], "accepted_tokens": accepted}


def span(records: list[RequestRecord]) -> float:
    """First send to last completion."""
    ends = [r.end for r in records if r.end is not None]
    return max(ends) - min(r.start for r in records) if ends else 0.0


def per_second(amount: float, duration: float) -> float | None:
    return amount / duration if duration > 0 else None


# ---- the server's own counters -----------------------------------------------------------------
def server_totals(samples: dict[str, float]) -> dict[str, float]:
    """Sums every series of the counters in SERVER_COUNTERS over labels, any prefix (treeserve:, vllm:)."""
    totals = {key: 0.0 for key in SERVER_COUNTERS}
    seen = set()
    for series, value in samples.items():
        base = series.split("{", 1)[0].rsplit(":", 1)[-1]
        for key, suffix in SERVER_COUNTERS.items():
            if base == suffix:
                totals[key] += value
                seen.add(key)
    return {key: totals[key] for key in seen}


def server_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    start, end = server_totals(before), server_totals(after)
    return {key: end[key] - start.get(key, 0.0) for key in end}


def server_queue_time_ms(server: dict) -> float | None:
    """Mean queue time the server reports (arrival to first scheduling) over the level."""
    count = server.get("queue_time_count")
    return 1000.0 * server["queue_time_sum_s"] / count if count else None


# ---- across levels -----------------------------------------------------------------------------
def saturation_index(throughputs: list[float | None], fraction: float = SATURATION_FRACTION) -> int | None:
    """The first level (in sweep order) whose output throughput reaches `fraction` of the best level's."""
    known = [t for t in throughputs if t is not None]
    if not known:
        return None
    best = max(known)
    return next(i for i, t in enumerate(throughputs) if t is not None and t >= fraction * best)
