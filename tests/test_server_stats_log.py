"""vLLM's periodic stats line: throughput over the interval, queues, KV usage, prefix hit rate."""
import logging
import time

import httpx

from conftest import API_KEY, wait_idle
from treeserve.server.metrics import ServerMetrics
from treeserve.server.stats_log import StatsLog


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_stats_line_reads_the_served_models_throughput_and_queues(server, caplog):
    clock = _Clock()
    stats = StatsLog(server.app.state.metrics, clock)
    usage = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello world", "max_tokens": 6,
                                                             "ignore_eos": True},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).json()["usage"]
    wait_idle(server.engine)
    clock.now += 2.0
    with caplog.at_level(logging.INFO, logger="treeserve.server.stats"):
        stats.log()
    [line] = [r for r in caplog.records if r.name == "treeserve.server.stats"]
    assert line.levelno == logging.INFO
    assert line.getMessage() == (f"Model tiny: Avg prompt throughput: {usage['prompt_tokens'] / 2:.1f} tokens/s, "
                                 "Avg generation throughput: 3.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, "
                                 "KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")


def test_an_idle_server_logs_its_stats_at_debug_after_one_quiet_interval(caplog):
    metrics = ServerMetrics()
    model = metrics.add_model(object(), "m")
    clock = _Clock()
    stats = StatsLog(metrics, clock)
    model.generation_tokens.inc(50)
    model.prefix_queries.inc(40)
    model.prefix_hits.inc(10)
    model.running.set(3)
    model.kv_usage.set(0.125)
    with caplog.at_level(logging.DEBUG, logger="treeserve.server.stats"):
        for _ in range(3):
            clock.now += 10
            stats.log()
    records = [r for r in caplog.records if r.name == "treeserve.server.stats"]
    # busy, then quiet once, then idle
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO, logging.DEBUG]
    assert "Avg generation throughput: 5.0 tokens/s, Running: 3 reqs" in records[0].getMessage()
    assert "KV cache usage: 12.5%, Prefix cache hit rate: 25.0%" in records[0].getMessage()
    assert "Avg generation throughput: 0.0 tokens/s" in records[1].getMessage()


def test_requests_are_logged_as_vllm_logs_them_only_when_enabled(server, caplog):
    from treeserve.server import request_log

    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 3}

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "treeserve.requests"]
    with caplog.at_level(logging.INFO):
        assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
        assert lines() == []  # off by default, as vLLM's
        request_log.enable(True)
        try:
            assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
            with httpx.stream("POST", server.url + "/v1/completions", headers=auth, timeout=60,
                              json=dict(body, max_tokens=400, ignore_eos=True, stream=True)) as resp:
                next(line for line in resp.iter_lines() if line.startswith("data: "))  # then hang up
            wait_idle(server.engine)
            deadline = time.monotonic() + 10
            while len(lines()) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            request_log.enable(False)
    received, finished, received_cut, aborted = lines()
    request_id = received.split(":")[0].removeprefix("Received request ")
    assert received.startswith(f"Received request {request_id}: prompt: 'Hello world', params: SamplingParams(")
    assert "prompt_token_ids: [" in received and finished == f"Finished request {request_id}."
    assert aborted == f"Aborted request {received_cut.split(':')[0].removeprefix('Received request ')}."


def test_a_logged_chat_request_shows_its_prompt_as_the_template_rendered_it(server, caplog):
    """vLLM's `Received request` line for a chat shows the rendered prompt; it read `prompt: None`."""
    from treeserve.server import request_log

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 3}
    with caplog.at_level(logging.INFO):
        request_log.enable(True)
        try:
            assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        finally:
            request_log.enable(False)
    received = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request chatcmpl-"))
    prompt = received.split(": prompt: ", 1)[1].split(", params: ")[0]
    assert prompt != "None" and "Hello world" in prompt, received


def test_a_stats_interval_that_is_not_a_positive_number_is_refused_naming_it(monkeypatch):
    """TREESERVE_LOG_STATS_INTERVAL=0 made the stats thread log in a loop without sleeping (holding the
    GIL the engine thread steps with); a non-number failed with float()'s bare message once the models
    had loaded."""
    import pytest

    from treeserve.server.stats_log import log_stats_interval

    for bad in ("0", "-5", "ten", "nan", "inf"):
        monkeypatch.setenv("TREESERVE_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="TREESERVE_LOG_STATS_INTERVAL"):
            log_stats_interval()
        with pytest.raises(ValueError, match="TREESERVE_LOG_STATS_INTERVAL"):
            StatsLog(ServerMetrics()).start()
    monkeypatch.setenv("TREESERVE_LOG_STATS_INTERVAL", "2.5")
    assert log_stats_interval() == 2.5
    monkeypatch.delenv("TREESERVE_LOG_STATS_INTERVAL")
    assert log_stats_interval() == 10.0
