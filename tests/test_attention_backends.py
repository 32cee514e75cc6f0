"""Choosing the attention backend: the argument, the environment variable, the CLI flag, and a clear
error for a choice that cannot run here."""
import pytest
import torch

from treeserve import LLM
from treeserve.config import EngineConfig
from treeserve.errors import ParamError
from treeserve.model.backends import ENV_VAR, resolve_backend_name

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend_name("auto", CPU, torch.float32) == "torch"
    assert resolve_backend_name("auto", torch.device("cuda"), torch.bfloat16) == "triton"


def test_the_environment_variable_sets_what_auto_means(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton on CPU is allowed only under the interpreter
    monkeypatch.setenv(ENV_VAR, "triton")
    assert resolve_backend_name("auto", CPU, torch.float32) == "triton"
    assert resolve_backend_name("torch", CPU, torch.float32) == "torch"  # an explicit choice wins
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ParamError, match=f"{ENV_VAR}='flash'"):
        resolve_backend_name("auto", CPU, torch.float32)


def test_unknown_backend_is_named_in_the_error():
    with pytest.raises(ParamError, match="attention_backend.*'flashinfer'"):
        EngineConfig(model=".", attention_backend="flashinfer")


def test_triton_on_cpu_needs_the_interpreter_and_a_dtype_it_has(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ParamError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", CPU, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ParamError, match="no torch.bfloat16"):
        resolve_backend_name("triton", CPU, torch.bfloat16)


def test_the_engine_runs_the_backend_it_resolved(llama_dir, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20)
    assert llm.engine.attention_backend == "torch" and llm.engine.model.backend.name == "torch_sdpa"
    assert llm.engine.runner.graphs is None


def test_serve_and_run_take_the_flags():
    from treeserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--attention-backend", "triton", "--enforce-eager"])
    assert args.attention_backend == "triton" and args.enforce_eager
    args = build_parser().parse_args(["run", "hi"])
    assert args.attention_backend == "auto" and not args.enforce_eager
