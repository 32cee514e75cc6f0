"""GuideLLM's default streaming benchmark (OpenAI HTTP backend, chat completions, streamed)
against a live `treeserve serve`: every request completes.

GuideLLM lives in its own virtualenv (made on first use under the user's cache, like the
benchmark peers): it pulls sanic and uvloop, with which uvicorn would change its event loop in
this suite's own servers, and pins click and multidict below what the test extra installs."""
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

from conftest import running_server

GUIDELLM = "guidellm==0.8.1"
VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "treeserve" / "tools" / "guidellm"


def _guidellm() -> Path:
    binary = VENV / "bin" / "guidellm"
    marker = VENV / ".installed"
    if marker.is_file() and marker.read_text() == GUIDELLM and binary.is_file():
        return binary
    venv.create(VENV, with_pip=True, clear=True)
    done = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", GUIDELLM],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"GuideLLM could not be installed ({GUIDELLM}): {done.stderr.strip()[-300:]}")
    marker.write_text(GUIDELLM)
    return binary


def test_guidellm_default_streaming_run_completes_every_request(llama_dir, tmp_path):
    from treeserve.server.launch import build_app

    binary = _guidellm()
    app = build_app(str(llama_dir), served_model_name="tiny", dtype="float32", device="cpu",
                    kv_cache_memory_bytes=16 << 20, max_model_len=512)
    report = tmp_path / "guidellm.json"
    with running_server(app) as url:
        done = subprocess.run(
            [str(binary), "run", "--backend", f"kind=openai_http,target={url}", "--profile", "kind=synchronous",
             "--constraint", "kind=max_requests,count=24",
             "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
             "--tokenizer", f"kind=huggingface_auto,model={llama_dir}", "--output", f"kind=json,path={report}",
             "--disable-console-interactive"],
            capture_output=True, text=True, timeout=600, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    assert benchmark["config"]["backend"]["stream"] is True  # GuideLLM's default: streamed chat completions
    totals = benchmark["metrics"]["request_totals"]
    assert totals["successful"] == totals["total"] == 24 and totals["errored"] == 0, totals
