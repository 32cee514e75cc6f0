"""The step token budget (`max_num_batched_tokens`) a server uses when none is given.

A step computes all of its tokens before any request sees its output, so the budget bounds how
long a step takes, and with it how soon prompts finish under load. When many prompts arrive at
once, a step of B tokens finishes B / L prompts of L tokens: the median time to first token is
the time to prefill about half of the burst, rounded up to whole steps, and smaller steps finish
the first prompts sooner. On CPU, where a step's time is its tokens times the model's work per
token, the serving budget holds each step's work near `SERVING_STEP_PARAM_TOKENS` (tokens x layer
parameters): 512 tokens for the ~150M benchmark model, the upper bound for the bundled and the
tests' tiny models, whose steps are short anyway and whose throughput needs the larger batches.
Measured on the 150M model over HTTP (docs/BENCHMARKS.md): TTFT p50 at 16 and 64 streams 20% and
40% lower at 512 than at 2048, output throughput unchanged. Offline (`LLM`, `Runtime`) keeps the
larger `EngineConfig` default: there throughput is all that counts.

A lone request (nothing else running or waiting) keeps nobody waiting behind its step, so its
prefill may take steps `LONE_REQUEST_FACTOR` times larger, up to `MAX_SERVING_BUDGET` (vLLM CPU's
server takes 2,048 always): fewer, fuller steps, where small ones cost a lone 1k-token prompt's
prefill a fifth on the 168M long-prompt model (4.75 s in steps of 256 against 3.92 s in one step,
offline; docs/BENCHMARKS.md "Long prompts"). A request that arrives meanwhile waits at most that
one larger step; from the next step the two share the serving budget.
"""
from __future__ import annotations

import torch

from treeserve.model.hf_config import ModelConfig

SERVING_STEP_PARAM_TOKENS = 5e10
MIN_SERVING_BUDGET = 256
MAX_SERVING_BUDGET = 2048
BUDGET_STEP = 256  # budgets are whole multiples of this
LONE_REQUEST_FACTOR = 4


def layer_params(config: ModelConfig) -> int:
    """Weights every token multiplies through (attention and MLP projections of every layer)."""
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return config.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size)


def serving_token_budget(config: ModelConfig, device: torch.device) -> int:
    if device.type != "cpu":
        return MAX_SERVING_BUDGET
    tokens = int(SERVING_STEP_PARAM_TOKENS / max(layer_params(config), 1))
    return max(MIN_SERVING_BUDGET, min(MAX_SERVING_BUDGET, tokens // BUDGET_STEP * BUDGET_STEP))


def lone_request_budget(serving_budget: int) -> int:
    """The step budget while one request is all the work (at least the serving budget)."""
    return max(serving_budget, min(MAX_SERVING_BUDGET, LONE_REQUEST_FACTOR * serving_budget))
