"""Benchmark metric definitions on hand-made timelines whose answers are worked out by hand."""
import math
import random
import statistics

import pytest

from treeserve.bench import metrics
from treeserve.bench.client import RequestRecord
from treeserve.bench.load import arrival_gaps


def record(start, chunks, end, tokens, success=True, prompt=10):
    return RequestRecord(index=0, level=0, warmup=False, start=start, end=end, chunk_times=list(chunks),
                         prompt_tokens=prompt, output_tokens=tokens, success=success, error="" if success else "boom")


def test_per_request_definitions():
    r = record(1.0, [1.1, 1.15, 1.25, 1.30], 1.31, tokens=4)
    assert metrics.ttft(r) == pytest.approx(0.1)
    assert metrics.e2e_latency(r) == pytest.approx(0.31)
    assert metrics.tpot(r) == pytest.approx((0.31 - 0.1) / 3)  # after the first token, per token
    assert metrics.inter_token_latencies(r) == pytest.approx([0.05, 0.10, 0.05])


def test_tpot_counts_tokens_not_chunks():
    # 9 tokens in 3 chunks (a server that batches its stream): TPOT uses the token count, ITL the chunks
    r = record(0.0, [0.2, 0.5, 0.8], 0.8, tokens=9)
    assert metrics.tpot(r) == pytest.approx(0.6 / 8)
    assert metrics.inter_token_latencies(r) == pytest.approx([0.3, 0.3])
    assert metrics.tpot(record(0.0, [0.2], 0.2, tokens=1)) == 0.0
    assert metrics.ttft(record(0.0, [], 0.5, tokens=3)) is None  # not streamed: no TTFT


def test_distribution_percentiles_interpolate():
    d = metrics.distribution([i / 1000 for i in range(1, 11)])  # 1..10 ms
    assert d["count"] == 10
    assert d["mean"] == pytest.approx(5.5)
    assert d["median"] == pytest.approx(5.5)
    assert d["p90"] == pytest.approx(9.1)  # 9 + 0.1 * (10 - 9)
    assert d["p99"] == pytest.approx(9.91)
    assert metrics.distribution([])["median"] is None


def test_parse_goodput():
    assert metrics.parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    for bad in (["ttfb:10"], ["ttft:abc"], ["ttft:-5"], ["ttft"]):
        with pytest.raises(ValueError, match="goodput"):
            metrics.parse_goodput(bad)


def level_timeline():
    return [
        record(0.0, [0.10, 0.20, 0.30], 0.30, tokens=3),   # TTFT 100, TPOT 100, e2e 300
        record(0.0, [0.25, 0.30, 0.35], 0.35, tokens=3),   # TTFT 250, TPOT 50, e2e 350
        record(0.5, [0.6, 0.9, 1.2], 1.2, tokens=3),       # TTFT 100, TPOT 300, e2e 700
        record(1.0, [], 2.0, tokens=None, success=False),  # failed; still inside the level's span
    ]


def test_goodput_counts_requests_meeting_every_slo():
    records = level_timeline()
    assert [metrics.meets_slos(r, {"ttft": 150}) for r in records] == [True, False, True, False]
    assert [metrics.meets_slos(r, {"ttft": 150, "tpot": 200}) for r in records] == [True, False, False, False]
    assert [metrics.meets_slos(r, {"e2el": 400}) for r in records] == [True, True, False, False]
    summary = metrics.summarize(records, {"ttft": 150, "tpot": 200})
    assert summary["goodput"] == pytest.approx(1 / 2.0)  # one good request over a 2 s span


def test_level_summary_throughputs():
    s = metrics.summarize(level_timeline())
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["duration_s"] == pytest.approx(2.0)  # first send (0.0) to last end (2.0)
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(19.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["count"] == 6 and s["itl_ms"]["mean"] == pytest.approx(150.0)
    assert s["e2el_ms"]["median"] == pytest.approx(350.0)
    assert s["errors"] == ["boom"]


def test_output_length_bins():
    records = [record(0, [0.1], 1.0, tokens=10), record(0, [0.1], 2.0, tokens=30),  # 10 and 15 tok/s
               record(0, [0.1], 1.0, tokens=31), record(0, [0.1], 10.0, tokens=300),  # 31 and 30 tok/s
               record(0, [0.1], 4.0, tokens=301), record(0, [0.1], 1.0, tokens=5, success=False)]
    bins = metrics.output_len_bins(records)
    assert bins["<=30"] == {"requests": 2, "mean_tokens_per_s": pytest.approx(12.5)}
    assert bins["31-300"] == {"requests": 2, "mean_tokens_per_s": pytest.approx(30.5)}
    assert bins[">300"] == {"requests": 1, "mean_tokens_per_s": pytest.approx(75.25)}


def test_server_counters_summed_over_labels_and_prefixes():
    before = {'treeserve:generation_tokens_total{model_name="a"}': 10.0,
              'treeserve:request_success_total{finished_reason="length",model_name="a"}': 1.0,
              'treeserve:request_queue_time_seconds_sum{model_name="a"}': 0.5,
              'treeserve:request_queue_time_seconds_count{model_name="a"}': 1.0}
    after = {'treeserve:generation_tokens_total{model_name="a"}': 40.0,
             'treeserve:request_success_total{finished_reason="length",model_name="a"}': 3.0,
             'treeserve:request_success_total{finished_reason="stop",model_name="a"}': 2.0,
             'treeserve:request_queue_time_seconds_sum{model_name="a"}': 2.5,
             'treeserve:request_queue_time_seconds_count{model_name="a"}': 5.0,
             'treeserve:request_queue_time_seconds_bucket{le="0.1",model_name="a"}': 5.0}
    delta = metrics.server_deltas(before, after)
    assert delta["generation_tokens"] == 30 and delta["requests_finished"] == 4
    assert metrics.server_queue_time_ms(delta) == pytest.approx(500.0)  # 2 s over 4 requests
    assert metrics.server_totals({"vllm:prompt_tokens_total": 7.0}) == {"prompt_tokens": 7.0}


def test_speculation_figures_from_the_servers_counters():
    """vLLM's counter names (and treeserve's, the same): acceptance over the level's change."""
    before = {"vllm:spec_decode_num_drafts_total": 10.0, "vllm:spec_decode_num_draft_tokens_total": 40.0,
              "vllm:spec_decode_num_accepted_tokens_total": 20.0}
    after = {"vllm:spec_decode_num_drafts_total": 30.0, "vllm:spec_decode_num_draft_tokens_total": 120.0,
             "vllm:spec_decode_num_accepted_tokens_total": 50.0}
    summary = metrics.summarize([], server=metrics.server_deltas(before, after))
    assert summary["spec_decode"]["acceptance_rate"] == pytest.approx(30 / 80)
    assert summary["spec_decode"]["acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert "spec_decode" not in metrics.summarize([], server=metrics.server_deltas({}, {}))


def test_saturation_is_first_level_near_the_best():
    assert metrics.saturation_index([100.0, 500.0, 960.0, 1000.0, 990.0]) == 2
    assert metrics.saturation_index([100.0, None, 300.0]) == 2
    assert metrics.saturation_index([None]) is None


def test_arrivals_poisson_and_gamma():
    rng = random.Random(0)
    poisson = arrival_gaps(20001, rate=10.0, burstiness=1.0, rng=rng)[1:]
    assert poisson[0] > 0 and statistics.mean(poisson) == pytest.approx(0.1, rel=0.03)
    assert statistics.stdev(poisson) / statistics.mean(poisson) == pytest.approx(1.0, rel=0.05)
    bursty = arrival_gaps(20001, rate=10.0, burstiness=0.25, rng=random.Random(1))[1:]
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.07)  # 1/sqrt(shape)
    assert arrival_gaps(3, rate=math.inf, burstiness=1.0, rng=rng) == [0.0, 0.0, 0.0]


def _reference_parse(text: str) -> dict[str, float]:
    """prometheus_client's own parser, keyed as the telemetry keys series."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return samples


def test_the_exposition_reader_agrees_with_prometheus_clients_parser():
    """On a registry's own text (escapes, spaces and braces in label values, histograms, +Inf,
    `_created` stamps), on a text with timestamps and unsorted labels as other servers write it, and
    read twice by one reader (its second read comes from its cache of series)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from treeserve.bench.telemetry import ExpositionReader

    registry = CollectorRegistry()
    odd = 'a "quoted\\ name}\nwith {spaces} = and, commas'
    Counter("requests", "Requests.", ["model", "reason"], registry=registry).labels(odd, "stop").inc(3)
    Gauge("running", "Running.", registry=registry).set(float("nan"))
    histogram = Histogram("latency_seconds", "Latency.", ["model"], buckets=(0.1, 1.0), registry=registry)
    for value in (0.05, 0.5, 5.0):
        histogram.labels("m").observe(value)
    exposition = generate_latest(registry).decode()
    foreign = ('# HELP vllm:x X.\n# TYPE vllm:x gauge\nvllm:x{zeta="1",alpha="2"} 7 1700000000000\n'
               'vllm:x{zeta="3",alpha="4"} -Inf\n')
    reader = ExpositionReader()
    for text in (exposition, foreign, exposition):
        ours, theirs = reader.read(text), _reference_parse(text)
        assert ours.keys() == theirs.keys()
        assert all(ours[k] == theirs[k] or (math.isnan(ours[k]) and math.isnan(theirs[k])) for k in ours)


def test_the_level_line_says_why_requests_failed():
    """Before, a level with failures printed '6/12 ok' and nothing of why (only summary.json had it)."""
    from treeserve.bench.report import render_level_line

    good = RequestRecord(index=0, level=0, warmup=False, start=0.0, end=1.0, chunk_times=[0.1, 0.2],
                         output_tokens=2, success=True, status=200)
    bad = RequestRecord(index=1, level=0, warmup=False, start=0.0, end=0.01,
                        error="ClientConnectorError: Cannot connect to host 127.0.0.1:8432")
    line = render_level_line({"concurrency": 2, **metrics.summarize([good, bad])}, "concurrency")
    assert "1/2 ok" in line and "1 failed, e.g. ClientConnectorError: Cannot connect" in line
    assert "failed" not in render_level_line({"concurrency": 2, **metrics.summarize([good])}, "concurrency")


def test_a_series_that_appears_mid_run_has_empty_cells_before(tmp_path):
    from treeserve.bench.telemetry import read_csv, write_union_csv

    rows = [{"t": 0.0, "time_unix": 1.0, "a": 1.0}, {"t": 0.1, "time_unix": 1.1, "a": 2.0, "late": 5.0}]
    header = write_union_csv(rows, tmp_path / "t.csv")
    assert header == ["t", "time_unix", "a", "late"]
    assert [row["late"] for row in read_csv(tmp_path / "t.csv")[1]] == [None, 5.0]
