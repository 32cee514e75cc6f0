"""Which `SamplingParams` fields a request body carries, and how: declared once here, read by the
OpenAI request models both for their fields (named, typed and defaulted as `SamplingParams`
declares them) and for the way back to `SamplingParams`. Every field of `SamplingParams` is in
exactly one of the four lists (tests/test_sampling_fields.py checks)."""
from __future__ import annotations

import dataclasses
import typing

from treeserve.sampling_params import SamplingParams

# Optional on the wire (default None): left out, the model's generation_config value applies, else
# SamplingParams's default.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# On the wire with SamplingParams's own type and default.
AS_DECLARED = ("n", "presence_penalty", "frequency_penalty", "seed", "min_tokens", "stop", "stop_token_ids",
               "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "bad_words", "allowed_token_ids",
               "truncate_prompt_tokens")
# Computed by each API from fields of its own (max_completion_tokens; logprobs, top_logprobs and echo;
# response_format; logit_bias's string keys; output_kind from stream), so not declared from here.
COMPUTED = ("max_tokens", "logprobs", "prompt_logprobs", "structured_outputs", "logit_bias", "output_kind")
# Offline only (vLLM's server has none of them: an OpenAI reply is text).
OFFLINE_ONLY = ("detokenize",)


def carried() -> list[dataclasses.Field]:
    """SamplingParams's fields a body carries as they are, in SamplingParams's order."""
    return [f for f in dataclasses.fields(SamplingParams) if f.name in MODEL_DEFAULTED + AS_DECLARED]


def request_fields() -> dict[str, tuple[object, object]]:
    """name -> (annotation, default) of each carried field, as pydantic's `create_model` takes them."""
    hints = typing.get_type_hints(SamplingParams)
    return {f.name: (hints[f.name] | None, None) if f.name in MODEL_DEFAULTED else (hints[f.name], f.default)
            for f in carried()}


def sampling_values(body, model_defaults: dict) -> dict:
    """`SamplingParams` keyword arguments from a body's carried fields; `model_defaults` (the model's
    generation_config) fills the model-defaulted ones the body leaves out."""
    values = {}
    for f in carried():
        value = getattr(body, f.name)
        if value is not None or f.name not in MODEL_DEFAULTED:
            values[f.name] = value
        elif f.name in model_defaults:
            values[f.name] = model_defaults[f.name]
    return values
