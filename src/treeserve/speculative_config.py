"""`SpeculativeConfig`: vLLM's `speculative_config` dict, validated."""
from __future__ import annotations

from dataclasses import dataclass, fields

from treeserve.errors import ParamError

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # the methods that load a `model` of their own
# vLLM's other methods: named, refused with a clear message until they are built
NOT_YET = ("medusa", "mlp_speculator", "ngram_gpu", "dflash", "dspark", "extract_hidden_states", "custom_class")
MAX_SPECULATIVE_TOKENS = 16
PROMPT_LOOKUP = (2, 4)  # prompt_lookup_min and _max where neither is given


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
    # unset: 2 to 4 (vLLM: 5 to 5); one given alone moves the other's default only where it would cross
    # it: {"prompt_lookup_min": 5} reads 5 to 5 and {"prompt_lookup_max": 1} 1 to 1, as in vLLM, but
    # {"prompt_lookup_min": 1} 1 to 4 (vLLM, where either alone sets both: 1 to 1)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None  # `draft_model`, `eagle`, `eagle3`: the draft checkpoint (a folder or a `builtin:` name)

    def __post_init__(self) -> None:
        if self.method in NOT_YET or is_mtp(self.method):
            kind = " (vLLM's multi-token prediction)" if is_mtp(self.method) else ""
            raise ParamError("speculative_config", f"method {self.method!r}{kind} is not supported by "
                             f"treeserve yet (supported: {', '.join(METHODS)})")
        if self.method not in METHODS:
            raise ParamError("speculative_config", f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            raise ParamError("speculative_config", f"method {self.method!r} needs a 'model' (the draft checkpoint)")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ParamError("speculative_config", f"method {self.method!r} takes no 'model' "
                             f"(a draft checkpoint is method 'draft_model')")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        self._fill_prompt_lookup()
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)

    def _fill_prompt_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None:  # (a max under 1 leaves the default: the error names the field given, not this one)
            low = min(PROMPT_LOOKUP[0], high) if _is_int(high) and high >= 1 else PROMPT_LOOKUP[0]
        if high is None:
            high = max(PROMPT_LOOKUP[1], low) if _is_int(low) else PROMPT_LOOKUP[1]
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

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


def is_mtp(method) -> bool:
    """vLLM's multi-token prediction methods: `mtp` and one per model family (`deepseek_mtp`,
    `qwen3_next_mtp`, ...; vLLM adds more with each release, so the suffix tells, not a list)."""
    return isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise ParamError("speculative_config", f"{name} must be an integer in [{low}, {high}], got {value!r}")
