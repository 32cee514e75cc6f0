"""The serving token budget: bounded step work on CPU, wired from `serve`'s default to the scheduler."""
import dataclasses

import torch

from treeserve import LLM, SamplingParams
from treeserve.bench.offline import MODEL_SHAPE
from treeserve.cli import build_parser
from treeserve.config import EngineConfig
from treeserve.engine import token_budget
from treeserve.engine.token_budget import serving_token_budget
from treeserve.model.hf_config import load_model_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _shaped(llama_dir, **shape):
    config = load_model_config(llama_dir)
    heads = shape.get("num_attention_heads", config.num_heads)
    return dataclasses.replace(
        config, hidden_size=shape.get("hidden_size", config.hidden_size),
        intermediate_size=shape.get("intermediate_size", config.intermediate_size),
        num_layers=shape.get("num_hidden_layers", config.num_layers), num_heads=heads,
        num_kv_heads=shape.get("num_key_value_heads", config.num_kv_heads),
        head_dim=shape.get("hidden_size", config.hidden_size) // heads)


def test_the_budget_shrinks_with_the_work_per_token_within_its_bounds(llama_dir):
    assert serving_token_budget(load_model_config(llama_dir), CPU) == token_budget.MAX_SERVING_BUDGET
    assert serving_token_budget(_shaped(llama_dir, **MODEL_SHAPE), CPU) == 512  # the ~150M benchmark model
    billion = _shaped(llama_dir, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16)
    assert serving_token_budget(billion, CPU) == token_budget.MIN_SERVING_BUDGET
    assert serving_token_budget(billion, CUDA) == token_budget.MAX_SERVING_BUDGET


def test_serve_defaults_to_the_serving_budget_and_offline_keeps_its_own():
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_num_batched_tokens is None
    assert parser.parse_args(["serve", "--max-num-batched-tokens", "700"]).max_num_batched_tokens == 700
    assert parser.parse_args(["run"]).max_num_batched_tokens == 2048
    assert EngineConfig(model="m").max_num_batched_tokens == 2048


def test_an_engine_without_a_budget_schedules_with_the_serving_one(llama_dir, monkeypatch):
    config = load_model_config(llama_dir)
    monkeypatch.setattr(token_budget, "SERVING_STEP_PARAM_TOKENS", 300 * token_budget.layer_params(config))
    llm = LLM(str(llama_dir), max_num_batched_tokens=None, dtype="float32", device="cpu")
    assert llm.engine.max_num_batched_tokens == 256 == llm.engine.scheduler.max_num_batched_tokens
    prompt = [1 + i % 50 for i in range(500)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert llm.engine.num_steps == 3  # 500 prompt tokens in steps of 256 and 244, then one decode
