"""The gateway's API fuzzed from its own OpenAPI schema (schemathesis; issue #40): every route,
the admin API and the OpenAI routes with the master key, the web chat's API with a signed-in
session cookie and its CSRF token, on SQLite and on PostgreSQL, in front of a real treeserve
server. No server error: a value the database cannot hold, or a row that does not exist, is a 4xx
naming the field."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("schemathesis", reason="schemathesis is a test dependency: pip install -e '.[test]'")
import gateway_fuzz  # noqa: E402

from conftest import API_KEY, running_server  # noqa: E402
from treeserve.gateway.app import build_app  # noqa: E402
from treeserve.gateway.chat.routes import COOKIE  # noqa: E402
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig  # noqa: E402

TESTS = Path(__file__).resolve().parent
assert gateway_fuzz.COOKIE == COOKIE

MASTER, USER, PASSWORD = gateway_fuzz.MASTER, gateway_fuzz.USER, gateway_fuzz.PASSWORD
CASES = 2000  # at least, over every operation, on each database


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """A real server of a tiny model, served as 'tiny'."""
    from treeserve.model.random_models import make_tiny_model
    from treeserve.server.launch import build_app as build_server

    path = make_tiny_model("llama", tmp_path_factory.mktemp("gw-fuzz") / "m", seed=3, max_position_embeddings=96)
    app = build_server(str(path), served_model_name="tiny", api_keys=[API_KEY], max_queue=64, dtype="float32",
                       device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=96)
    with running_server(app) as url:
        yield url
    app.state.engine.shutdown()


def _gateway(backend: str, database: str):
    models = {"tiny": ModelConfig("tiny", [BackendConfig(backend, api_key=API_KEY)], input_cost_per_token=1e-6,
                                  output_cost_per_token=2e-6, max_tokens=16)}
    return build_app(GatewayConfig(models=models, master_key=MASTER, database=database, health_interval=0,
                                   chat={"enabled": True}))


def test_no_server_error_on_any_gateway_route(backend, postgres, tmp_path):
    """SQLite and PostgreSQL, each its own gateway fuzzed by its own process, both at once."""
    databases = {"sqlite": f"sqlite:///{tmp_path / 'gw.db'}", "postgresql": postgres.new_database()}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(running_server(_gateway(backend, database)))
                for name, database in databases.items()}
        for url in urls.values():
            created = httpx.post(url + "/user/new", json={"user_id": USER, "password": PASSWORD},
                                 headers={"Authorization": f"Bearer {MASTER}"})
            assert created.status_code == 200, created.text
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        fuzzers = {name: subprocess.Popen([sys.executable, str(TESTS / "gateway_fuzz.py"), url], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for name, url in urls.items()}
        outputs = {name: proc.communicate(timeout=600) for name, proc in fuzzers.items()}
    for name, (out, err) in outputs.items():
        assert fuzzers[name].returncode == 0, err[-3000:]
        result = json.loads(out)
        print(f"schemathesis on the gateway ({name}): {result['operations']} operations, {result['calls']} "
              f"generated requests, {len(result['server_errors'])} server errors")
        assert not result["server_errors"], result["server_errors"]
        assert result["calls"] >= CASES, result["calls"]
