"""Broker mode: the gateway publishes requests to RabbitMQ (a real broker, started by the fixture),
two `treeserve worker`s consume them; one is killed mid-run. No non-streamed request is lost or
answered twice (the killed worker's unacknowledged requests are redelivered to the other); a
stream the killed worker had started ends with an error event, never replayed."""
from __future__ import annotations

import concurrent.futures
import threading

import openai

from conftest import API_KEY, running_server
from gateway_support import rabbitmq, wait_for, workers  # noqa: F401  (rabbitmq: a fixture)
from test_gateway_failover import TOKENS, _request
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-master-broker"


def test_two_workers_one_killed_mid_run(llama_dir, tmp_path, rabbitmq):
    with workers(llama_dir, 2, rabbitmq, API_KEY) as procs:
        models = {"tiny": ModelConfig("tiny", [BackendConfig(rabbitmq, timeout=60)], input_cost_per_token=1e-6,
                                      output_cost_per_token=1e-4)}
        config = GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}")
        app = build_app(config)
        with running_server(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=90)
            finished = []

            def kill_when_busy():
                wait_for(lambda: len(finished) >= 10, timeout=120)
                procs[1].kill()

            killer = threading.Thread(target=kill_when_busy)
            killer.start()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(_request, client, i) for i in range(40)]
                for future in concurrent.futures.as_completed(futures, timeout=240):
                    finished.append(future.result())
            killer.join()
            assert procs[1].poll() is not None, "the worker was not killed"
            plain = [r for r in finished if not r["stream"]]
            assert len(plain) == 20 and all(r["usage"]["completion_tokens"] == TOKENS for r in plain)
            streams = [r for r in finished if r["stream"]]
            assert all(r["usage"]["completion_tokens"] == TOKENS for r in streams if not r.get("error"))
            app.state.store.flush()
            rows = app.state.store.spend_logs(limit=1000)
            assert len(rows) == 40 and len({row["request_id"] for row in rows}) == 40  # one answer each
            logs = {row["request_id"]: row for row in rows}
            for r in finished:
                got = r["usage"] or {"prompt_tokens": 0, "completion_tokens": 0}
                row = logs[r["id"]]
                assert (row["prompt_tokens"], row["completion_tokens"]) == \
                    (got["prompt_tokens"], got["completion_tokens"]), (r, row)
                assert row["status"] == ("cut" if r.get("error") else "success") and row["backend"] == rabbitmq
            print({"streams_cut": sum(bool(r.get("error")) for r in streams)})
