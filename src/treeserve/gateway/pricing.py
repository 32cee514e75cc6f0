"""What a request may cost at most (reserved before it is sent) and what it did cost (settled)."""
from __future__ import annotations

import json

from treeserve.gateway.config import DEFAULT_RESERVED_TOKENS, ModelConfig

# Tokens a chat template adds around each message (role markers, separators): generous on purpose.
TEMPLATE_TOKENS_PER_MESSAGE = 16


def prompt_token_bound(body: dict) -> int:
    """An upper bound on the prompt's tokens without a tokenizer: its UTF-8 bytes (a byte-level BPE
    token covers at least one byte), plus template tokens per message; tool definitions count too."""
    size = len(json.dumps(body.get("tools") or [], ensure_ascii=False).encode()) if body.get("tools") else 0
    if isinstance(body.get("messages"), list):
        size += len(json.dumps(body["messages"], ensure_ascii=False).encode())
        return size + TEMPLATE_TOKENS_PER_MESSAGE * len(body["messages"])
    prompt = body.get("prompt", body.get("problem", body.get("question", "")))
    return size + len(json.dumps(prompt, ensure_ascii=False).encode()) + TEMPLATE_TOKENS_PER_MESSAGE


def completion_cap(body: dict) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def completion_token_bound(body: dict, model: ModelConfig) -> int:
    """max_tokens (else the model's configured cap, which the gateway then sends upstream) per
    choice, per prompt."""
    cap = completion_cap(body)
    choices = body.get("n") if isinstance(body.get("n"), int) and body.get("n") > 0 else 1
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if cap is None:
        cap = model.max_tokens or DEFAULT_RESERVED_TOKENS
    return cap * choices * prompts


def worst_cost(body: dict, model: ModelConfig) -> float:
    return (prompt_token_bound(body) * model.input_cost_per_token
            + completion_token_bound(body, model) * model.output_cost_per_token)


def cost(model: ModelConfig, prompt_tokens: int, completion_tokens: int) -> float:
    return prompt_tokens * model.input_cost_per_token + completion_tokens * model.output_cost_per_token
