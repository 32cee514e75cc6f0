"""`SpeculativeConfig`: vLLM's `speculative_config` dict, validated."""
from __future__ import annotations

from dataclasses import dataclass, fields

from treeserve.errors import ParamError

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # the methods that load a `model` of their own
# vLLM's other methods: named, refused with a clear message until they are built
NOT_YET = ("medusa", "mlp_speculator", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """- `ngram` (prompt lookup): the longest n-gram (prompt_lookup_max down to prompt_lookup_min
      tokens) ending the sequence is looked up in the sequence's own prompt and output; the tokens
      that followed its latest earlier occurrence are the draft.
    - `suffix`: the same lookup over every sequence of the request's draft group (the `n` samples of
      one request, or every sequence of one search problem: the siblings' text).
    `disable_by_batch_size`: no drafts in a step while this many requests (or more) run: a full
    batch is bound by compute, where verifying drafts costs more than it saves."""
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    model: str | None = None  # `draft_model`, `eagle`, `eagle3`: the draft checkpoint (a folder or a `builtin:` name)

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ParamError("speculative_config", f"method {self.method!r} is not supported yet "
                             f"(supported: {', '.join(METHODS)})")
        if self.method not in METHODS:
            raise ParamError("speculative_config", f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            raise ParamError("speculative_config", f"method {self.method!r} needs a 'model' (the draft checkpoint)")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ParamError("speculative_config", f"method {self.method!r} takes no 'model' "
                             f"(a draft checkpoint is method 'draft_model')")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """From vLLM's dict (unknown keys are an error naming them), a config, or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ParamError("speculative_config", f"must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ParamError("speculative_config", f"unknown key(s) {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(sorted(known))})")
        if "method" not in value and "model" in value:  # vLLM's reading of a bare draft model
            value = {**value, "method": "draft_model"}
        if "method" not in value:
            raise ParamError("speculative_config", "needs a 'method' (one of " + ", ".join(METHODS) + ")")
        return cls(**value)


def _int_in(name: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ParamError("speculative_config", f"{name} must be an integer in [{low}, {high}], got {value!r}")
