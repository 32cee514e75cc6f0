"""What a request may cost at most (reserved before it is sent) and what it did cost (settled), in
the prices of each model (`input_cost_per_token`, `output_cost_per_token` in the gateway's YAML)."""
from __future__ import annotations

import json

from treeserve.gateway.config import DEFAULT_RESERVED_TOKENS, ModelConfig
from treeserve.wire.errors import APIError

# Tokens a chat template adds around each message (role markers, separators): generous on purpose.
TEMPLATE_TOKENS_PER_MESSAGE = 16
# The most completion tokens one request is counted to reserve: more than any request generates (a
# 10M-token context x n=128 is 2^30). A client's `max_tokens: 1e20` or `n: 1e400` is counted as this, so
# a worst case stays a number a BIGINT holds and a float converts (else a 500), and small enough that a
# key's `reserved`, a float sum of its requests' holds, keeps the others' holds (a worst case of 1e17
# beside holds of 0.05 absorbed them: released, it took them with it, and the budget grew by as much).
MOST_COMPLETION_TOKENS = 1 << 32


# The fields a worst case counts: each a JSON integer where given. A backend that reads `n: 4.0` or
# `max_completion_tokens: "900"` as 4 or 900 (pydantic's lax ints: vLLM's; llama.cpp's JSON) generated
# that many while the gateway, unable to count them, held one choice or the model's cap (which it sends
# as `max_tokens`, and such a `max_completion_tokens` overrode); OpenAI's API refuses them, as this does.
COUNTED = ("n", "best_of", "max_tokens", "max_completion_tokens")
SEARCH_COUNTED = ("num_iterations", "lookahead")
_KINDS = {float: "a decimal number", str: "a string", bool: "a boolean", list: "an array", dict: "an object"}


def check_counts(body: dict, search: bool = False) -> None:
    """An APIError (400) naming the first counted field given as anything but an integer (null is left out)."""
    for name in COUNTED + (SEARCH_COUNTED if search else ()):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise APIError(400, f"{name}: expected an integer, got {_KINDS.get(type(value), 'another type')}",
                           param=name, code="invalid_type")


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
    """The most tokens a choice may write as the client asked: the larger of `max_completion_tokens` and
    `max_tokens` where both are given (a backend may honour either: vLLM's and SGLang's read
    `max_completion_tokens or max_tokens`, so there a `max_completion_tokens: 0` is none at all and
    `max_tokens` counts; llama.cpp's reads `max_tokens`); None where neither caps it (the model's cap
    then goes upstream as `max_tokens`)."""
    caps = [value for name in ("max_completion_tokens", "max_tokens")
            if _whole(value := body.get(name)) and (value > 0 or name == "max_tokens")]
    return max(caps) if caps else None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def completion_token_bound(body: dict, model: ModelConfig, search: bool = False) -> int:
    """max_tokens (else the model's configured cap, which the gateway then sends upstream) per
    choice, per prompt; for a search (`/v1/search`), per generation call it may make."""
    cap = completion_cap(body)
    if cap is None:
        cap = model.max_tokens or (SEARCH_DEFAULTS["max_tokens"] if search else DEFAULT_RESERVED_TOKENS)
    if search:
        return min(cap * search_generation_calls(body), MOST_COMPLETION_TOKENS)
    choices = max(_count(body, "n", 1), _count(body, "best_of", 1))  # (best_of: generated, one returned)
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return min(cap * choices * prompts, MOST_COMPLETION_TOKENS)


# A search request's defaults (wire/search.py's SearchRequest)
SEARCH_DEFAULTS = {"n": 4, "num_iterations": 40, "lookahead": 0, "max_tokens": 2048, "strategy": "beam"}


def search_generation_calls(body: dict) -> int:
    """The most generation calls (each of at most max_tokens) a search makes: beam search and DVTS
    sample n steps at each of num_iterations depths and roll each out `lookahead` steps further;
    the other strategies write n whole completions."""
    n = _count(body, "n", SEARCH_DEFAULTS["n"])
    if body.get("strategy", SEARCH_DEFAULTS["strategy"]) not in ("beam", "dvts"):
        return n
    depth = _count(body, "num_iterations", SEARCH_DEFAULTS["num_iterations"])
    lookahead = body.get("lookahead", SEARCH_DEFAULTS["lookahead"])
    lookahead = lookahead if isinstance(lookahead, int) and not isinstance(lookahead, bool) and lookahead > 0 else 0
    return n * depth * (1 + lookahead)


def _count(body: dict, name: str, default: int) -> int:
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def worst_tokens(body: dict, model: ModelConfig, search: bool = False) -> int:
    return prompt_token_bound(body) + completion_token_bound(body, model, search)


def worst_cost(body: dict, model: ModelConfig, search: bool = False) -> float:
    return (prompt_token_bound(body) * model.input_cost_per_token
            + completion_token_bound(body, model, search) * model.output_cost_per_token)


def cost(model: ModelConfig, prompt_tokens: int, completion_tokens: int) -> float:
    return prompt_tokens * model.input_cost_per_token + completion_tokens * model.output_cost_per_token


NO_PRICES = ("no model has a price (input_cost_per_token, output_cost_per_token under its name in the gateway's "
             "--config YAML): every request costs 0, so max_budget never refuses one")


def unpriced_budgets(keys: int, users: int) -> str:
    """The warning a gateway without prices logs at startup for the keys and users with a max_budget."""
    return f"{keys} key(s) and {users} user(s) have a max_budget, but {NO_PRICES}"
