"""Two real `treeserve serve` replicas behind the gateway; one is killed mid-run. Every
non-streamed request succeeds (retried on the other replica: nothing had reached its client);
every streamed one finishes or ends with an error event (never replayed, never hanging); spend logs
equal the usage the client received, and a cut stream is billed for the tokens its client got."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import openai

from conftest import API_KEY, running_server
from gateway_support import replicas, wait_for
from treeserve.gateway.app import build_app
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig

MASTER = "sk-master-failover"
TOKENS = 48


def _request(client: openai.OpenAI, i: int) -> dict:
    messages = [{"role": "user", "content": f"Request number {i}: tell me something"}]
    extra = {"min_tokens": TOKENS}
    if i % 2 == 0:
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=TOKENS,
                                                                extra_body=extra)
        answer = raw.parse()
        return {"i": i, "stream": False, "id": raw.headers["x-request-id"], "usage": answer.usage.model_dump()}
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=TOKENS, stream=True, extra_body=extra,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    result = {"i": i, "stream": True, "id": raw.headers["x-request-id"], "usage": None, "error": None}
    try:
        for chunk in raw.parse():
            if chunk.usage is not None:
                result["usage"] = chunk.usage.model_dump()
    except openai.APIError as exc:  # the gateway's error event after a backend broke off
        result["error"] = str(exc)
    return result


def test_sixty_requests_with_a_replica_killed_mid_run(llama_dir, tmp_path):
    with replicas(llama_dir, 2, API_KEY) as procs:
        models = {"tiny": ModelConfig("tiny", [BackendConfig(url, api_key=API_KEY) for url, _ in procs],
                                      input_cost_per_token=1e-6, output_cost_per_token=1e-4)}
        config = GatewayConfig(models=models, master_key=MASTER, database=f"sqlite:///{tmp_path / 'gw.db'}",
                               routing="round_robin", health_interval=0.5)
        app = build_app(config)
        with running_server(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=60)
            finished = []

            def kill_when_busy():
                wait_for(lambda: len(finished) >= 12, timeout=120)
                procs[1][1].kill()

            killer = threading.Thread(target=kill_when_busy)
            killer.start()
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(_request, client, i) for i in range(60)]
                for future in concurrent.futures.as_completed(futures, timeout=240):
                    finished.append(future.result())
            killer.join()
            elapsed = time.monotonic() - started
            assert procs[1][1].poll() is not None, "the replica was not killed"
            plain = [r for r in finished if not r["stream"]]
            streams = [r for r in finished if r["stream"]]
            assert len(plain) == 30 and all(r["usage"]["completion_tokens"] == TOKENS for r in plain)
            cut = [r for r in streams if r["error"]]
            assert all(r["usage"] and r["usage"]["completion_tokens"] == TOKENS for r in streams if not r["error"])
            app.state.store.flush()
            rows = wait_for(lambda: len(app.state.store.spend_logs(limit=1000)) == 60, timeout=20) \
                and app.state.store.spend_logs(limit=1000)
            logs = {row["request_id"]: row for row in rows}
            for r in finished:
                row = logs[r["id"]]
                got = r["usage"] or {"prompt_tokens": 0, "completion_tokens": 0}
                assert (row["prompt_tokens"], row["completion_tokens"]) == \
                    (got["prompt_tokens"], got["completion_tokens"]), (r, row)
                assert row["status"] == ("cut" if r.get("error") else "success")
            print(json.dumps({"seconds": round(elapsed, 1), "streams_cut": len(cut),
                              "cut_tokens_billed": [logs[r["id"]]["completion_tokens"] for r in cut],
                              "backends": sorted({row["backend"] for row in logs.values()})}))
