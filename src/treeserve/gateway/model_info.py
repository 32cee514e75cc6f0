"""LiteLLM's `/model/info` answer: one entry per deployment (a backend of a model), its
`litellm_params` (the model's name at that backend, its URL, its timeout) beside its `model_info`
(the model's prices, token cap, fallbacks and backends). No secret is in it: a backend's `api_key`
never, its URL with its password as *** (LiteLLM drops `api_key` and masks credentials the same way)."""
from __future__ import annotations

from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig
from treeserve.gateway.keys import KeyRecord


def model_info(config: GatewayConfig, key: KeyRecord) -> dict:
    """Each deployment of each model `key` may use, in the configuration's order."""
    return {"data": [_deployment(name, model, backend) for name, model in config.models.items() if key.allows(name)
                     for backend in model.backends]}


def _deployment(name: str, model: ModelConfig, backend: BackendConfig) -> dict:
    return {"model_name": name, "litellm_params": litellm_params(name, backend), "model_info": {
        "input_cost_per_token": model.input_cost_per_token, "output_cost_per_token": model.output_cost_per_token,
        "max_tokens": model.max_tokens, "fallbacks": model.fallbacks,
        "backends": [b.name for b in model.backends]}}


def litellm_params(name: str, backend: BackendConfig) -> dict:
    """What LiteLLM's config calls a deployment's `litellm_params`, secrets left out: `api_key` is
    never shown, and `api_base` is the URL with its password as *** (`BackendConfig.name`)."""
    return {"model": backend.model or name, "api_base": backend.name, "timeout": backend.timeout}
