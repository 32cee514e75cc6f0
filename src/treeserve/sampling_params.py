"""Per-request sampling settings, with vLLM's names and defaults, validated on construction."""
from __future__ import annotations

import dataclasses
import enum
import json as json_module
from dataclasses import dataclass, field

from treeserve.errors import ParamError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names): exactly one of a JSON schema (`json`, a dict or its
    JSON text), any JSON object (`json_object`), a regular expression, one of `choice`'s strings,
    or a Lark / GBNF `grammar`."""
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ParamError("structured_outputs", f"give exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError("structured_outputs.json", f"must be a JSON schema (object or text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParamError(f"structured_outputs.{name}", f"must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ParamError("structured_outputs.choice", f"must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    def source(self) -> tuple[str, str]:
        """(format, text) for the grammar engine; also the grammar cache's key."""
        if self.json is not None:
            # (in its own key order: a JSON schema's properties are written in the order given, as OpenAI's)
            schema = self.json if isinstance(self.json, str) else json_module.dumps(self.json)
            return "json_schema", schema
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json_module.dumps(list(self.choice))
        return "grammar", self.grammar


def _structured_outputs(fields: dict) -> StructuredOutputsParams:
    """A dict of StructuredOutputsParams' fields; one it lacks (vLLM's `structural_tag`, say) is named."""
    known = {field.name for field in dataclasses.fields(StructuredOutputsParams)}
    for name in fields:
        if name not in known:
            raise ParamError(f"structured_outputs.{name}", "not implemented by treeserve; give exactly one of json, "
                             "regex, choice, grammar, json_object")
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as exc:  # (a key that is not a string)
        raise ParamError("structured_outputs", str(exc)) from exc


class RequestOutputKind(enum.Enum):
    """What each of a request's `RequestOutput`s holds (vLLM's names)."""
    CUMULATIVE = 0  # everything so far: text, token ids and logprobs from the first token on
    DELTA = 1       # only what is new since its last output (streaming callers: no copy that grows)
    FINAL_ONLY = 2  # one output, when it finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16    # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None    # number of top logprobs per generated token (plus the sampled one); -1: all
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (plus the prompt's own); -1: all
    structured_outputs: StructuredOutputsParams | dict | None = None  # a grammar the output must match
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: words never generated (the last token of each word's tokens, alone and after a space, is
    # masked wherever the tokens before it end the output so far)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens are ever sampled
    truncate_prompt_tokens: int | None = None   # vLLM's: only the prompt's last k tokens (-1: max_model_len)
    detokenize: bool = True                     # vLLM's: False leaves each output's text empty (token ids only)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    # the engine's: `bad_words` as token sequences, set by the engine from its tokenizer when it takes
    # the request (engine/token_masks.py)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_strings = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        if self.allowed_token_ids is not None and isinstance(self.allowed_token_ids, (list, tuple, set)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured_outputs(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(_is_number(self.temperature) and 0 <= self.temperature < float("inf"), "temperature",
                 f"must be >= 0 and finite, got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _require(self.seed is None or (_is_int(self.seed) and -2 ** 63 <= self.seed < 2 ** 64), "seed",
                 f"must be an integer in [-2**63, 2**64) (a 64-bit seed), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):  # (-1, vLLM's: the whole vocabulary, engine/request_intake.py)
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value >= -1), name,
                     f"must be an integer >= 0, or -1 for the whole vocabulary, got {value!r}")
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", f"must be StructuredOutputsParams, got {self.structured_outputs!r}")
        _require(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items())),
            "logit_bias", f"must map token ids (>= 0) to numbers in [-100, 100], got {self.logit_bias!r}")
        _require(isinstance(self.output_kind, RequestOutputKind), "output_kind",
                 f"must be a RequestOutputKind, got {self.output_kind!r}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"must be a list of non-negative integers, got {self.stop_token_ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):  # ("no" is truthy)
            _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        self._validate_vllm_extras()

    def _validate_vllm_extras(self) -> None:
        """vLLM's bad_words, allowed_token_ids, truncate_prompt_tokens and detokenize, as vLLM checks them
        (the vocabulary and max_model_len are the engine's checks: engine/request_intake.py)."""
        allowed = self.allowed_token_ids
        _require(allowed is None or (isinstance(allowed, list) and all(_is_int(t) and t >= 0 for t in allowed)),
                 "allowed_token_ids", f"must be a list of token ids (integers >= 0), got {allowed!r}")
        _require(allowed is None or len(allowed) > 0, "allowed_token_ids",
                 "must not be empty (no token could be sampled); leave it out to allow every token")
        truncate = self.truncate_prompt_tokens
        _require(truncate is None or (_is_int(truncate) and (truncate >= 1 or truncate == -1)),
                 "truncate_prompt_tokens", f"must be an integer >= 1 or -1 (the model's max length), got {truncate!r}")
        _require(isinstance(self.detokenize, bool), "detokenize", f"must be true or false, got {self.detokenize!r}")
        _require(self.detokenize or not self.stop_strings, "stop",
                 "stop strings need detokenize=True (they are found in the text); use stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        fields.update(changes)
        copy = SamplingParams(**fields)
        if copy.bad_words == self.bad_words:  # (the engine's tokens of the same words stay good)
            copy.bad_words_token_ids = self.bad_words_token_ids
        return copy


def _normalise_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ParamError("stop", f"must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ParamError("stop", "stop strings must be non-empty")
    return tuple(stop)


def _normalise_stop_token_ids(token_ids) -> list:
    if token_ids is None:
        return []
    if not isinstance(token_ids, (list, tuple, set, frozenset)):
        raise ParamError("stop_token_ids", f"must be a list of non-negative integers, got {token_ids!r}")
    return list(token_ids)


def _normalise_bad_words(words) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or \
            not all(isinstance(w, str) for w in words):
        raise ParamError("bad_words", f"must be a list of strings, got {words!r}")
    if any(not w.strip() for w in words):
        raise ParamError("bad_words", f"must not contain an empty (or blank) word, got {list(words)!r}")
    return list(dict.fromkeys(words))  # (vLLM's: duplicates once)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ParamError(name, message)


@dataclass
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search` (entrypoints/beam_search.py says how they are used)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _require(_is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
                 f"must be an integer >= 1, got {self.beam_width!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_number(self.temperature) and 0 <= self.temperature < float("inf"), "temperature",
                 f"must be >= 0 and finite, got {self.temperature!r}")
        _require(_is_number(self.length_penalty) and abs(self.length_penalty) < float("inf"), "length_penalty",
                 f"must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
