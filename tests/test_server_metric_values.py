"""/metrics values checked exactly against what the engine did, as a vLLM dashboard reads them:
token counters, finishes by reason, for requests that end and for requests whose client leaves."""
import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import API_KEY, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _scrape(url: str) -> dict[str, float]:
    """Each sample by name and its labels but model_name (one model here)."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=AUTH).text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def _moved(before: dict[str, float], after: dict[str, float], *names: str) -> dict[str, float]:
    return {name: after.get(name, 0) - before.get(name, 0) for name in names}


def _post_and_leave(server, body: dict) -> None:
    """Sends a non-streamed request and hangs up once each of its samples has a few tokens."""
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                     + payload)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            groups = list(server.engine.groups.values())
            if groups and all(c.num_output_tokens >= 3 for g in groups for c in g.children):
                return
            time.sleep(0.005)


COUNTERS = ("treeserve:prompt_tokens_total", "treeserve:generation_tokens_total",
            "treeserve:request_success_total{finished_reason=abort}",
            "treeserve:request_success_total{finished_reason=length}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_leaves_counts_its_prompt_tokens_and_samples(server, stream):
    """vLLM counts a request's prompt once prefilled and its tokens as they are generated, whatever
    ends it. An aborted request's prompt was never counted here, a non-streamed one's tokens neither
    (they reach no output), a streamed one's last tokens only if an output carried them, and n samples
    cut by the abort counted as one `abort` where n that finish count n."""
    engine, cut = server.engine, []
    original = engine.abort_request

    def abort_request(request_id):
        group = engine.groups.get(request_id)
        if group is not None:
            cut.append((len(group.prompt_token_ids), [c.num_output_tokens for c in group.children]))
        return original(request_id)

    before = _scrape(server.url)
    engine.abort_request = abort_request
    try:
        body = {"model": "tiny", "prompt": "Go on forever", "max_tokens": 400, "n": 2, "ignore_eos": True,
                "stream": stream}
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
                chunks = 0
                for line in resp.iter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 4:
                        break  # hang up mid-answer
        else:
            _post_and_leave(server, body)
        deadline = time.monotonic() + 20
        while not cut and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.abort_request = original
    wait_idle(engine)
    assert len(cut) == 1, cut
    prompt_tokens, generated = cut[0]
    assert min(generated) > 0, "aborted before its first tokens: nothing to check"
    moved = _moved(before, _scrape(server.url), *COUNTERS)
    assert moved == {"treeserve:prompt_tokens_total": prompt_tokens,
                     "treeserve:generation_tokens_total": sum(generated),
                     "treeserve:request_success_total{finished_reason=abort}": 2,
                     "treeserve:request_success_total{finished_reason=length}": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_finished_requests_count_exactly_their_usage(server, stream):
    """n=2, max_tokens=5: the counters move by the usage the answer reports."""
    before = _scrape(server.url)
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "n": 2, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True}} if stream else \
        {"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "n": 2, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        usage = chunks[-1]["usage"]
    else:
        usage = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["usage"]
    wait_idle(server.engine)
    after = _scrape(server.url)
    moved = _moved(before, after, *COUNTERS, "treeserve:e2e_request_latency_seconds_count",
                   "treeserve:request_prompt_tokens_sum", "treeserve:request_generation_tokens_sum",
                   "treeserve:request_generation_tokens_count", "treeserve:request_max_num_generation_tokens_sum",
                   "treeserve:request_params_n_sum", "treeserve:request_params_max_tokens_sum",
                   "treeserve:request_inference_time_seconds_count")
    itl, tpot = ("inter_token_latency_seconds", "time_per_output_token_seconds")
    gaps = _moved(before, after, *(f"treeserve:{name}_{part}" for name in (itl, tpot) for part in ("count", "sum")))
    assert gaps[f"treeserve:{itl}_count"] == usage["completion_tokens"] - 2  # (each sample's after its first)
    assert gaps[f"treeserve:{tpot}_count"] == gaps[f"treeserve:{itl}_count"]
    assert gaps[f"treeserve:{tpot}_sum"] == gaps[f"treeserve:{itl}_sum"]
    assert moved == {"treeserve:prompt_tokens_total": usage["prompt_tokens"],
                     "treeserve:generation_tokens_total": usage["completion_tokens"],
                     "treeserve:request_success_total{finished_reason=abort}": 0,
                     "treeserve:request_success_total{finished_reason=length}": 2,
                     "treeserve:e2e_request_latency_seconds_count": 1,
                     "treeserve:request_prompt_tokens_sum": usage["prompt_tokens"],
                     "treeserve:request_generation_tokens_sum": usage["completion_tokens"],
                     "treeserve:request_generation_tokens_count": 1,
                     "treeserve:request_max_num_generation_tokens_sum": 5,  # each sample: max_tokens
                     "treeserve:request_params_n_sum": 2, "treeserve:request_params_max_tokens_sum": 5,
                     "treeserve:request_inference_time_seconds_count": 1}


# What vLLM's Grafana dashboard queries (examples/online_serving/prometheus_grafana/grafana.json)
VLLM_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total", "time_per_output_token_seconds_bucket",
    "time_per_output_token_seconds_sum", "time_per_output_token_seconds_count", "num_requests_running",
    "num_requests_waiting", "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count", "gpu_cache_usage_perc", "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum")


def test_every_series_vllms_grafana_dashboard_reads_is_served_with_a_model_name(server):
    """docs/METRICS.md: a vLLM dashboard ports by renaming `vllm:` to `treeserve:`. Its Time Per Output
    Token, Cache Utilization, Prompt/Generation Length and Max Generation Token panels had no data."""
    httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
               headers=AUTH, timeout=60)
    wait_idle(server.engine)
    served = {(sample.name, sample.labels.get("model_name"))
              for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", headers=AUTH).text)
              for sample in family.samples}
    missing = [name for name in VLLM_DASHBOARD_SERIES if (f"treeserve:{name}", "tiny") not in served]
    assert not missing, missing
    gauges = _scrape(server.url)
    assert gauges["treeserve:gpu_cache_usage_perc"] == gauges["treeserve:kv_cache_usage_perc"]


# vLLM v1's bucket bounds (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
VLLM_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_BUCKETS = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0),
    "itl": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e": VLLM_REQUEST_LATENCY, "queue_time": VLLM_REQUEST_LATENCY, "prefill_time": VLLM_REQUEST_LATENCY,
    "decode_time": VLLM_REQUEST_LATENCY,
    "request_prompt_tokens": (1, 2, 5, 10, 20, 50, 100, 200, 500),  # 1-2-5 up to max_model_len (512 here)
    "request_generation_tokens": (1, 2, 5, 10, 20, 50, 100, 200, 500),
}


def test_histograms_have_every_bucket_bound_of_vllms(server):
    """A dashboard's histogram_quantile and `le` selectors read the same as on vLLM: every one of its
    bounds is there (finer ones may be added below). Here the request-phase histograms ended at 640 s, so
    the p99 of a 20-minute reasoning request read 640 s, and `le="60.0"` (an SLO) matched nothing."""
    metrics = server.app.state.metrics.by_engine[id(server.engine)]
    for name, bounds in VLLM_BUCKETS.items():
        ours = set(getattr(metrics, name).upper_bounds)
        assert ours >= {float(b) for b in bounds}, (name, sorted({float(b) for b in bounds} - ours))


def test_each_finish_reason_is_served_at_zero_before_its_first_finish():
    """vLLM makes request_success's stop, length and abort series at 0: a series that first appears at 1
    has no earlier sample, so rate() and increase() miss that first abort (the one an alert waits for)."""
    from treeserve.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.add_model(object(), "m")
    served = {sample.labels["finished_reason"]: sample.value
              for family in text_string_to_metric_families(metrics.render().decode())
              for sample in family.samples if sample.name == "treeserve:request_success_total"}
    assert served == {"stop": 0, "length": 0, "abort": 0}


def test_each_draft_position_is_served_at_zero_before_its_first_accepted_token():
    """vLLM makes spec_decode_num_accepted_tokens_per_pos's series for positions 0 to
    num_speculative_tokens - 1 at 0 when it starts (a series appeared at its first accepted token, so
    rate() missed it, and a position never accepted had no series to read 0 from); an engine that does
    not speculate serves none."""
    from types import SimpleNamespace

    from treeserve.server.metrics import ServerMetrics
    from treeserve.speculative_config import SpeculativeConfig

    def per_position(engine) -> dict[str, float]:
        metrics = ServerMetrics()
        metrics.add_model(engine, "m")
        return {sample.labels["position"]: sample.value
                for family in text_string_to_metric_families(metrics.render().decode())
                for sample in family.samples if sample.name == "treeserve:spec_decode_num_accepted_tokens_per_pos_total"
                if sample.labels["model_name"] == "m"}

    ngram = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3})
    assert per_position(SimpleNamespace(config=SimpleNamespace(speculative_config=ngram))) == {"0": 0, "1": 0, "2": 0}
    assert per_position(SimpleNamespace(config=SimpleNamespace(speculative_config=None))) == {}
    assert per_position(object()) == {}


def _one_step(metrics, output) -> dict[str, float]:
    """One finished output through a model's metrics, as the engine thread's step observer passes it."""
    from types import SimpleNamespace

    from treeserve.engine.engine_stats import EngineStats

    zeros = {name: 0 for name in EngineStats.__dataclass_fields__}
    stats = EngineStats(**{**zeros, "kv_blocks_total": 1, "spec_decode_num_accepted_tokens_per_pos": ()})
    engine = SimpleNamespace(stats=lambda: stats, last_step_num_tokens=1)
    metrics.add_model(engine, "m")
    metrics.on_step(engine, [output])
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_vllms_request_parameter_and_phase_histograms_are_served_with_exact_values():
    """vLLM V1 serves request_params_n, request_params_max_tokens, request_inference_time_seconds,
    request_time_per_output_token_seconds and request_prefill_kv_computed_tokens; none was served here.
    One request: n=2, max_tokens=5, a 7-token prompt with 4 cached, samples of 5 and 3 tokens, arrived at
    100 s, scheduled at 100.5, first token at 101, finished at 103."""
    from treeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from treeserve.server.metrics import ServerMetrics

    samples = [CompletionOutput(index=i, text="", token_ids=[1] * count, cumulative_logprob=None,
                                logprobs=None, finish_reason="length")
               for i, count in enumerate((5, 3))]
    timing = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                            finished_time=103.0, n=2, max_tokens=5)
    output = RequestOutput("r", None, list(range(7)), samples, True, num_cached_tokens=4, metrics=timing)
    got = _one_step(ServerMetrics(), output)
    expected = {"request_params_n": (1, 2), "request_params_max_tokens": (1, 5),
                "request_inference_time_seconds": (1, 2.5), "request_prefill_time_seconds": (1, 0.5),
                "request_decode_time_seconds": (1, 2.0), "request_queue_time_seconds": (1, 0.5),
                "e2e_request_latency_seconds": (1, 3.0),
                "request_time_per_output_token_seconds": (1, 0.5),  # 2 s over the longest sample's 4 gaps
                "request_prefill_kv_computed_tokens": (1, 3)}
    assert {name: (got[f"treeserve:{name}_count"], got[f"treeserve:{name}_sum"]) for name in expected} == expected
    assert got["treeserve:request_params_n_bucket{le=1.0}"] == 0 and got["treeserve:request_params_n_bucket{le=2.0}"] == 1


def test_a_streamed_tokens_gap_is_observed_once_per_step_and_served_under_both_names():
    """The engine thread runs on_step after every step: time_per_output_token_seconds (vLLM's older
    name of inter_token_latency_seconds) was a second histogram observed for every streamed output of
    every step, and a delta request's tokens were tallied per sample in a dict each step; with 256
    streams that doubled on_step's time (160 -> 340 us a step). It now mirrors the ITL histogram, and
    the longest sample is the engine's count, given on the finished output."""
    from types import SimpleNamespace

    from treeserve.engine.engine_stats import EngineStats
    from treeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from treeserve.server.metric_series import Histogram
    from treeserve.server.metrics import ServerMetrics

    def step(finished: bool = False) -> RequestOutput:
        sample = CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None, logprobs=None,
                                  finish_reason="length" if finished else None)
        timing = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                                finished_time=103.0 if finished else None, n=1, max_tokens=3,
                                longest_sample=3 if finished else 0)
        return RequestOutput("r", None, [1, 2], [sample], finished, metrics=timing, delta=True)

    zeros = {name: 0 for name in EngineStats.__dataclass_fields__}
    stats = EngineStats(**{**zeros, "kv_blocks_total": 1, "spec_decode_num_accepted_tokens_per_pos": ()})
    engine = SimpleNamespace(stats=lambda: stats, last_step_num_tokens=1)
    metrics = ServerMetrics()
    model = metrics.add_model(engine, "m")
    metrics.on_step(engine, [step()])  # (its first token: TTFT)
    observed, original = [], Histogram.observe

    def observe(self, value, count=1):
        observed.append(self)
        return original(self, value, count)

    Histogram.observe = observe
    try:
        metrics.on_step(engine, [step()])
    finally:
        Histogram.observe = original
    assert [h for h in observed if h is not model.iteration_tokens] == [model.itl]
    metrics.on_step(engine, [step(finished=True)])
    values = {sample.name: sample.value for family in text_string_to_metric_families(metrics.render().decode())
              for sample in family.samples}
    for part in ("count", "sum"):
        assert values[f"treeserve:time_per_output_token_seconds_{part}"] == \
            values[f"treeserve:inter_token_latency_seconds_{part}"]
    assert values["treeserve:time_per_output_token_seconds_count"] == 2
    # a delta output's last holds only its last token: the sample's 3 are the engine's count
    assert values["treeserve:request_max_num_generation_tokens_sum"] == 3


def test_a_non_streamed_request_counts_its_prompt_and_tokens_while_it_runs(server):
    """vLLM counts a request's prompt once its prefill is done and its tokens step by step, whether it
    streams or not (its engine core reports every step; only the caller's output is final-only).
    Here a non-streamed request (one output, at its end) moved prompt_tokens_total and
    generation_tokens_total only when it finished: `rate()` read 0 while it ran, the periodic stats
    line showed 0 tokens/s (and, after an interval, went to DEBUG) with requests running."""
    engine, body = server.engine, {"model": "tiny", "prompt": "Go on forever", "max_tokens": 400,
                                   "ignore_eos": True}
    before = _scrape(server.url)
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:  # (closed at the end: the request is aborted)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                     + payload)
        deadline, group = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            group = next(iter(list(engine.groups.values())), None)
            if group is not None and group.children[0].num_output_tokens >= 12:
                break
            time.sleep(0.005)
        assert group is not None and not group.finished, "the request ended before it could be read mid-run"
        moved = _moved(before, _scrape(server.url), *COUNTERS[:2])
        running = not group.finished
    wait_idle(engine)
    assert running, "the request ended before the scrape: nothing to check"
    assert moved["treeserve:prompt_tokens_total"] == len(group.prompt_token_ids)
    assert moved["treeserve:generation_tokens_total"] >= 10  # (the scrape may miss a step or two)


def test_iteration_tokens_observes_each_step_that_ran_the_model_once(llama_dir):
    """iteration_tokens_total is tokens computed per engine step: its count the engine's steps, its sum
    the tokens they computed. The step observers also run for a step that computed nothing (with async
    scheduling and output processing, CUDA's defaults: one that only landed the results of a step left
    running, or made deferred text), and each such step was observed as a 0-token iteration."""
    from types import SimpleNamespace

    from conftest import running_server
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=256, async_scheduling=True,
                    async_output_processing=True)
    with running_server(app) as url:
        engine, server = app.state.engine.engine, SimpleNamespace(url=url)
        before, stats = _scrape(url), engine.stats()
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "ignore_eos": True, "stream": stream}
            assert httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
            wait_idle(engine)
        after, done = _scrape(server.url), engine.stats()
    assert done.num_steps_left_running > 0, "no step was left running: nothing to check"
    moved = _moved(before, after, "treeserve:iteration_tokens_total_count", "treeserve:iteration_tokens_total_sum")
    assert moved == {"treeserve:iteration_tokens_total_count": done.num_steps - stats.num_steps,
                     "treeserve:iteration_tokens_total_sum": done.num_tokens_computed - stats.num_tokens_computed}
