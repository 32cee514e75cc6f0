"""/metrics: prometheus_client's text, byte for byte, at a fraction of its cost (a scrape holds the GIL
that the engine thread needs between its ops), rendered on the HTTP thread without waiting for the
engine thread."""
import re
import sys
import threading

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conftest import API_KEY, wait_idle
from treeserve.server.engine_metrics import EngineMetrics
from treeserve.server.metrics import ServerMetrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BUCKETS = (0.001, 0.5, 1.0, 8.0, 640.0)
ODD_NAME = 'a "quoted\\ name\nwith a newline'


def _unstamped(text: str) -> str:
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text)


def test_the_text_is_prometheus_clients_byte_for_byte():
    ours, reference = ServerMetrics(), CollectorRegistry()
    doc = "A doc with a back\\slash\nand a newline."
    for kind, cls, name in (("gauge", Gauge, "g"), ("counter", Counter, "c"), ("histogram", Histogram, "h"),
                            ("counter", Counter, "unused")):
        options = {"buckets": BUCKETS} if kind == "histogram" else {}
        family = ours.family(kind, name, doc, **options)
        theirs = cls(f"treeserve:{name}", doc, ["model_name", "finished_reason"], registry=reference, **options)
        if name == "unused":
            continue
        for model in ("m", ODD_NAME):
            mine, their = family.labels(model_name=model, finished_reason="stop"), theirs.labels(model, "stop")
            for value in (0, 0.001, 0.0007, 1.0, 3, 639.9, 1e4, 2.5e6):  # on, between and past the bounds
                if kind == "gauge":
                    mine.set(value)
                    their.set(value)
                elif kind == "counter":
                    mine.inc(value)
                    their.inc(value)
                else:
                    mine.observe(value)
                    their.observe(value)
    assert _unstamped(ours.render().decode()) == _unstamped(generate_latest(reference).decode())


def _python_calls(fn) -> tuple[object, int]:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls


def test_a_scrape_formats_numbers_only_and_an_unchanged_state_not_even_those(server):
    """The GIL a render holds is what a scrape costs the engine thread: the label text of every line is
    built once, so a render makes about one Python call per line (prometheus_client's generate_latest
    made about 14: it re-escaped every label of every sample), and a scrape that finds nothing changed
    since the last one serves the same bytes."""
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5},
                      headers=AUTH, timeout=60)
    assert resp.status_code == 200
    wait_idle(server.engine)
    metrics = server.app.state.metrics
    body, calls = _python_calls(metrics.render)  # something changed since the last scrape: formats again
    lines = body.count(b"\n")
    assert lines > 150 and calls < 3 * lines, (calls, lines)
    again, calls = _python_calls(metrics.render)
    assert again is body and calls < 50, calls


def test_a_scrape_neither_runs_on_the_engine_thread_nor_waits_for_it(server, monkeypatch):
    metrics, loop = server.app.state.metrics, server.async_engine.loop
    entered, release = threading.Event(), threading.Event()
    engine_thread, rendered_on = [], []

    def stuck_step(engine, outputs) -> None:  # the engine thread, stuck mid-step
        engine_thread.append(threading.current_thread())
        entered.set()
        release.wait(30)
    render = metrics.render
    monkeypatch.setattr(metrics, "render", lambda: rendered_on.append(threading.current_thread()) or render())
    loop.step_observers.append(stuck_step)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
    request = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                               kwargs={"json": body, "headers": AUTH, "timeout": 60})
    try:
        request.start()
        assert entered.wait(30), "the engine did not step"
        scrape = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=5)
        assert scrape.status_code == 200 and b"treeserve:num_requests_running" in scrape.content
    finally:
        loop.step_observers.remove(stuck_step)
        release.set()
        request.join(60)
    assert rendered_on and engine_thread[0] not in rendered_on, (rendered_on, engine_thread)
    wait_idle(server.engine)


def test_delta_outputs_count_each_samples_tokens_and_finish_once():
    """A streamed request's outputs are deltas: its samples end on different steps and its last output
    holds only what changed, yet every sample's finish and every token is counted once."""
    from treeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    metrics = EngineMetrics(ServerMetrics(), "m")

    def delta(finished, *samples):
        outs = [CompletionOutput(i, "x" * n, [7] * n, None, None, reason) for i, n, reason in samples]
        return RequestOutput("r", None, [1, 2], outs, finished, metrics=RequestMetrics(0.0, 0.0, 0.1), delta=True)
    steps = [delta(False, (0, 1, None), (1, 1, None), (2, 1, None)),
             delta(False, (0, 1, "length"), (1, 1, None), (2, 1, None)),  # sample 0 ends here
             delta(True, (1, 1, "stop"), (2, 1, "stop"))]                   # the last output: samples 1 and 2
    for output in steps:
        metrics._observe_tokens(output, 1.0)
        metrics._count_finishes(output)
    success = {reason: metrics._success(reason).value for reason in ("length", "stop")}
    assert success == {"length": 1, "stop": 2}
    # every token once in the request's tally (its request_generation_tokens observation); the
    # generation_tokens counter is the engine's count (test_server_metric_values.py)
    assert metrics._seen_tokens["r"][0] == 8


def test_a_final_only_output_observes_its_inter_token_latency_at_the_mean_gap():
    """A non-streamed request (final-only: one output) still feeds the inter-token-latency histogram:
    each sample's tokens after its first, at the mean gap between its first token and its end. Its two
    samples of 5 tokens each took 1.6 s for their 4 gaps (0.4 s a gap: vLLM runs them as two requests,
    each observing its own); the gaps were taken as 1.6 s over all 8 (0.2 s, half the real gap)."""
    from treeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    metrics = EngineMetrics(ServerMetrics(), "m")
    outs = [CompletionOutput(i, "x", [7] * 5, None, None, "length") for i in range(2)]
    output = RequestOutput("r", None, [1, 2], outs, True, metrics=RequestMetrics(0.0, 0.5, 1.0, 2.6))
    metrics._observe_tokens(output, 3.0)
    assert sum(metrics.itl.counts) == 8 and abs(metrics.itl.sum - 8 * 0.4) < 1e-9
    assert sum(metrics.ttft.counts) == 1 and abs(metrics.ttft.sum - 1.0) < 1e-9
    assert metrics._seen_tokens["r"][0] == 10


def test_samples_that_step_together_each_observe_the_whole_gap():
    """n=2 streamed (delta outputs): each step gives both samples a token, 0.25 s apart; each sample's
    gap is 0.25 s (vLLM runs the samples as two requests, each observing its own gap), not 0.125 s (the
    step's gap was divided by both samples' tokens). A speculative step's tokens of one sample still
    share its gap; a final-only request with samples of unequal length takes its longest's gap."""
    from treeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    metrics = EngineMetrics(ServerMetrics(), "m")

    def delta(*tokens):
        outs = [CompletionOutput(i, "x", [7] * count, None, None, None) for i, count in enumerate(tokens) if count]
        return RequestOutput("r", None, [1, 2], outs, False, metrics=RequestMetrics(0.0, 0.0, 1.0), delta=True)
    metrics._observe_tokens(delta(1, 1), 1.0)   # the first tokens: no gap
    metrics._observe_tokens(delta(1, 1), 1.25)
    assert sum(metrics.itl.counts) == 2 and abs(metrics.itl.sum - 2 * 0.25) < 1e-9
    metrics._observe_tokens(delta(3, 0), 1.55)  # one sample, three tokens in one (speculative) step
    assert sum(metrics.itl.counts) == 5 and abs(metrics.itl.sum - (0.5 + 0.3)) < 1e-9

    final = EngineMetrics(ServerMetrics(), "m")
    outs = [CompletionOutput(i, "x", [7] * count, None, None, "stop") for i, count in enumerate((5, 3))]
    final._observe_tokens(RequestOutput("f", None, [1], outs, True, metrics=RequestMetrics(0.0, 0.5, 1.0, 2.0)), 2.0)
    assert sum(final.itl.counts) == 6 and abs(final.itl.sum - 6 * 0.25) < 1e-9  # 1 s over the longest's 4 gaps
