"""The fields /v1/completions and /v1/chat/completions share (OpenAI's plus vLLM's extras) and their
mapping to `SamplingParams`; the bound on top-logprob counts both APIs check."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from treeserve.errors import ParamError
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams
from treeserve.wire.sampling_fields import request_fields, sampling_values

MAX_N = 128
MAX_TOP_LOGPROBS = 20


def top_count(name: str, value: int | None) -> int | None:
    """A count of top logprobs (None: not asked for), within OpenAI's bound."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ParamError(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage so far in every chunk
    # OpenAI's: random padding in each chunk against size side channels; taken with no effect, as vLLM
    # (no padding is sent: the official clients never read it); it was a 400 "unknown parameter"
    include_obfuscation: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` (exactly one field); a key it does not know is named in a 400."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _ModelBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None  # (as vLLM's: left out, the server's one generator; the gateway asks for it)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, body):
        """A field sent as null is a field left out (OpenAI's schema makes `n`, the penalties,
        `stream`, `logprobs` ... nullable: clients that send a whole request object send nulls)."""
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body


# n, temperature, top_p, stop, seed, ...: SamplingParams's fields as wire/sampling_fields.py carries them
_SampledBody = create_model("_SampledBody", __base__=_ModelBody, **request_fields())


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class SamplingRequest(_SampledBody):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's: the waiting queue's order (lower first; 0 interactive, 1 background: the gateway's batch
    # lines, behind which no interactive request waits), FCFS within one priority
    priority: int = Field(default=0, ge=0, le=1)
    # vLLM's: the prompt's token ids and each choice's generated ones beside the text (streamed: the
    # prompt's in the first chunk, each chunk's new ones in it)
    return_token_ids: bool = False
    # Accepted only as far as they are implemented (a 400 names them otherwise), never dropped.
    best_of: int | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    prediction: dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    # vLLM's older structured-output fields (its structured_outputs replaced them): named, not ignored
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None

    def reject_unimplemented(self) -> None:
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise ParamError(name, "is OpenAI's deprecated form; use tools and tool_choice (chat completions)")
        for name in GUIDED_FIELDS:
            if getattr(self, name) is not None:
                new = name.removeprefix("guided_")
                raise ParamError(name, f"is vLLM's older form; use structured_outputs: {{\"{new}\": ...}}")
        for name in ("prediction", "audio"):
            if getattr(self, name) is not None:
                raise ParamError(name, "is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", f"only best_of equal to n ({self.n}) is supported, got {self.best_of}")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ParamError("modalities", f"only ['text'] is supported, got {self.modalities}")

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its token-id keys as integers."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.lstrip("-").isdigit()):  # ("²" and "٣" are digits to str.isdigit)
                raise ParamError("logit_bias", f"keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return bias

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The grammar `response_format` or `structured_outputs` asks for (not both)."""
        wanted = self.response_format is not None and self.response_format.type != "text"
        if wanted and self.structured_outputs is not None:
            raise ParamError("structured_outputs", "give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            body = self.structured_outputs
            return StructuredOutputsParams(json=body.json_schema, regex=body.regex, choice=body.choice,
                                           grammar=body.grammar, json_object=body.json_object)
        if not wanted:
            return None
        if self.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        spec = self.response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise ParamError("response_format.json_schema.schema", "type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=spec.json_schema)

    @property
    def structured_param(self) -> str:
        """The request's name for its grammar, for errors."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def sampling_params(self, defaults: dict, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.n > MAX_N:
            raise ParamError("n", f"must be <= {MAX_N}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "only with stream: true (as vLLM and OpenAI)")
        self.reject_unimplemented()
        return SamplingParams(**sampling_values(self, defaults), max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, structured_outputs=self.structured_spec(),
                              logit_bias=self.token_bias())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats
