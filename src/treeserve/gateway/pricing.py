"""What a request may cost at most (reserved before it is sent) and what it did cost (settled)."""
from __future__ import annotations

import json

from treeserve.gateway.config import ModelConfig

# Tokens a chat template adds around each message (role markers, separators): generous on purpose.
TEMPLATE_TOKENS_PER_MESSAGE = 16


def prompt_token_bound(body: dict) -> int:
    """An upper bound on the prompt's tokens without a tokenizer: its UTF-8 bytes (a byte-level BPE
    token covers at least one byte), plus template tokens per message."""
    if isinstance(body.get("messages"), list):
        size = len(json.dumps(body["messages"], ensure_ascii=False).encode())
        return size + TEMPLATE_TOKENS_PER_MESSAGE * len(body["messages"])
    prompt = body.get("prompt", body.get("problem", ""))
    return len(json.dumps(prompt, ensure_ascii=False).encode()) + TEMPLATE_TOKENS_PER_MESSAGE


def completion_token_bound(body: dict, model: ModelConfig) -> int:
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or model.max_tokens
    choices = body.get("n") or 1
    try:
        return max(0, int(limit)) * max(1, int(choices))
    except (TypeError, ValueError):
        return model.max_tokens


def worst_cost(body: dict, model: ModelConfig) -> float:
    return (prompt_token_bound(body) * model.input_cost_per_token
            + completion_token_bound(body, model) * model.output_cost_per_token)


def cost(model: ModelConfig, prompt_tokens: int, completion_tokens: int) -> float:
    return prompt_tokens * model.input_cost_per_token + completion_tokens * model.output_cost_per_token
