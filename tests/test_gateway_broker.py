"""Broker mode: the gateway publishes requests to RabbitMQ (a real broker, started by the fixture),
two `treeserve worker`s consume them; one is killed mid-run. No non-streamed request is lost or
answered twice (the killed worker's unacknowledged requests are redelivered to the other); a
stream the killed worker had started ends with an error event, never replayed. The survivor,
stopped by SIGTERM with a stream in hand, finishes it before it exits."""
from __future__ import annotations

import json

import httpx
import openai

from conftest import API_KEY, running_server
from gateway_support import check_answers_and_bills, run_and_kill, wait_for, workers
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig, url_without_userinfo

MASTER = "sk-master-broker"


def test_two_workers_one_killed_mid_run(llama_dir, tmp_path, rabbitmq):
    with workers(llama_dir, 2, rabbitmq, API_KEY) as procs:
        models = {"tiny": ModelConfig("tiny", [BackendConfig(rabbitmq, timeout=60)], input_cost_per_token=1e-6,
                                      output_cost_per_token=1e-4)}
        config = GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}")
        app = build_app(config)
        with running_server(app) as url:
            def backends():
                return httpx.get(url + "/health/backends", headers={"Authorization": f"Bearer {MASTER}"}).json()

            assert wait_for(lambda: backends()[0].get("consumers") == 2), backends()
            assert backends()[0]["healthy"] and backends()[0]["queue_depth"] == 0
            client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=90)
            finished = run_and_kill(client, 40, procs[1].kill, after=10)
            assert procs[1].poll() is not None, "the worker was not killed"
            logs = check_answers_and_bills(finished, app.state.store.ledger)
            # (the backend's label: no broker password, nor its user)
            assert {row["backend"] for row in logs.values()} == {url_without_userinfo(rabbitmq)}
            assert all("guest" not in row["backend"] for row in logs.values())
            metrics = app.state.metrics.render().decode()
            assert "guest@" not in metrics and "treeserve_gateway:broker_queue_consumers{" in metrics
            # the survivor stopped by SIGTERM with a stream in hand: it takes nothing more, finishes the stream, exits 0
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on"}],
                                                    max_tokens=300, stream=True, extra_body={"min_tokens": 300},
                                                    stream_options={"include_usage": True})
            chunks = iter(stream)
            next(chunks)
            procs[0].terminate()
            rest = list(chunks)
            assert rest[-1].usage.completion_tokens == 300, rest[-2:]
            assert procs[0].wait(60) == 0
            log = procs[0].stderr.read().decode()
            assert "draining the requests in hand" in log, log[-2000:]
            redelivered = log.count(" redelivered: ")
            killed_log = procs[1].stderr.read().decode()  # (it was killed: its pipe is at its end)
            assert redelivered > 0, ("the survivor was given none of the killed worker's requests; the killed "
                                     f"worker's log: {killed_log[-1500:]}\nthe survivor's: {log[-1500:]}")
            print(json.dumps({"streams_cut": sum(bool(r["stream"] and r["error"]) for r in finished),
                              "redelivered": redelivered}))


def test_a_model_no_worker_consumes_fails_at_once(tmp_path, rabbitmq):
    import time

    models = {"idle": ModelConfig("idle", [BackendConfig(rabbitmq, timeout=60)])}
    config = GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}", retries=0)
    with running_server(build_app(config)) as url:
        health = httpx.get(url + "/health/backends", headers={"Authorization": f"Bearer {MASTER}"}).json()[0]
        assert wait_for(lambda: httpx.get(url + "/health/backends", headers={"Authorization": f"Bearer {MASTER}"})
                        .json()[0].get("consumers") == 0), health
        client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=30)
        started = time.monotonic()
        try:
            client.chat.completions.create(model="idle", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("answered without a worker")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and "no worker consumes" in exc.message
        assert time.monotonic() - started < 10
