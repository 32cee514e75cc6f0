"""Two real `treeserve serve` replicas behind the gateway; one is killed mid-run. Every
non-streamed request succeeds (retried on the other replica: nothing had reached its client);
every streamed one finishes or ends with an error event (never replayed, never hanging); spend logs
equal the usage the client received, and a cut stream is billed for the tokens its client got."""
from __future__ import annotations

import json
import time

import openai

from conftest import API_KEY, running_server
from gateway_support import check_answers_and_bills, replicas, retries_total, run_and_kill
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-master-failover"


def test_sixty_requests_with_a_replica_killed_mid_run(llama_dir, tmp_path):
    with replicas(llama_dir, 2, API_KEY) as procs:
        models = {"tiny": ModelConfig("tiny", [BackendConfig(url, api_key=API_KEY) for url, _ in procs],
                                      input_cost_per_token=1e-6, output_cost_per_token=1e-4)}
        # No health checks and no circuit breaker: the dead replica stays in the plan, so requests are
        # sent to it after the kill and must be retried on the other (with them, whether any is sent
        # there first is a race: the streams cut by the kill alone can open the breaker; CI saw 0 retries)
        config = GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}",
                               routing="round_robin", health_interval=0, breaker_failures=1_000_000)
        app = build_app(config)
        with running_server(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=60)
            started = time.monotonic()
            finished = run_and_kill(client, 60, procs[1][1].kill, after=12)
            elapsed = time.monotonic() - started
            assert procs[1][1].poll() is not None, "the replica was not killed"
            logs = check_answers_and_bills(finished, app.state.store.ledger)
            # the requests sent to the dead replica (in flight with nothing sent yet, or sent after the kill)
            # went to the other one
            assert retries_total(app) > 0, "no request was retried"
            cut = [r for r in finished if r["stream"] and r["error"]]
            # told in the chat's words, not the exception's name (ClientPayloadError; the log has it)
            assert all("answer broke off (its server stopped answering)" in r["error"] for r in cut), cut
            print(json.dumps({"seconds": round(elapsed, 1), "streams_cut": len(cut),
                              "cut_tokens_billed": [logs[r["id"]]["completion_tokens"] for r in cut],
                              "backends": sorted({row["backend"] for row in logs.values()}),
                              "retries": retries_total(app)}))
