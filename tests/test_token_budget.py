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


def test_a_lone_request_may_take_larger_steps_up_to_the_largest_budget():
    assert token_budget.lone_request_budget(256) == 1024
    assert token_budget.lone_request_budget(512) == token_budget.MAX_SERVING_BUDGET
    assert token_budget.lone_request_budget(token_budget.MAX_SERVING_BUDGET) == token_budget.MAX_SERVING_BUDGET
    assert token_budget.lone_request_budget(4096) == 4096  # never below the serving budget


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
    engine = llm.engine
    assert engine.shared_num_batched_tokens == 256 == engine.scheduler.shared_num_batched_tokens
    assert engine.max_num_batched_tokens == 1024 == engine.scheduler.max_num_batched_tokens
    sizes, step = [], engine.step
    monkeypatch.setattr(engine, "step", lambda: (step(), sizes.append(engine.last_step_num_tokens))[0])
    params = SamplingParams(max_tokens=2, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": [1 + i % 50 for i in range(500)]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert sizes == [500, 1]  # alone: its whole prompt in one step, then one decode
    sizes.clear()
    two = [{"prompt_token_ids": [1 + (i * 7 + k) % 47 for i in range(500)]} for k in (1, 2)]
    out = llm.generate(two, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
    # Two prompts of 500 share steps of the serving budget: the first's prompt ends in step 2 and its
    # last token is step 3's decode; alone from step 4, the second takes what is left of its prompt.
    assert sizes == [256, 256, 256, 233, 1]
