"""OpenAI request bodies (pydantic, strict types) and their mapping to `SamplingParams`."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from treeserve.errors import ParamError
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams
from treeserve.template_roles import template_role
from treeserve.tool_arguments import parse_arguments
from treeserve.wire.sampling_fields import request_fields, sampling_values
from treeserve.wire.unsupported import Unsupported, VendorRequest

MAX_N = 128
MAX_TOP_LOGPROBS = 20


def _top_count(name: str, value: int | None) -> int | None:
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
    model: str

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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Part(BaseModel):
    """A part of a request body: strict types, unknown keys ignored (as OpenAI does)."""
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Part):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None      # calls forced by tool_choice always validate; auto reads what comes

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict | None) -> dict | None:
        """A call's arguments are a JSON object (OpenAI refuses another schema type: a forced call of
        one could never be read as a call)."""
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(f'must be a JSON schema of type "object" (a call\'s arguments are an object), '
                             f"got type {parameters.get('type')!r}")
        return parameters


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Part):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Part):
    """OpenAI's newer form: the model may call these of the tools only, as `mode` says."""
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(_Part):
    """An assistant message's earlier call, sent back in the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    # ("function": OpenAI's deprecated form of a tool's result, named by the function; passed to the
    # template as it is, as vLLM does)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None           # tool messages: the call this answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """A part that is not text (image_url, input_audio, file ...) named in the 400: the served
        models read text only (it read "Input should be a valid string")."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError("content_part", "part {index} is of type {kind}: only text parts are "
                                          "supported (the served models read text only)",
                                          {"index": i, "kind": repr(kind)})
        return content

    def as_template_message(self, where: str = "messages") -> dict:
        """The message as chat templates read it (a call's arguments as an object, as HF's
        templates expect); ParamError naming `where` for what no template can render."""
        content = self.content
        if isinstance(content, list):  # (joined by newlines, as vLLM's, and LLM.chat's)
            content = "\n".join(part.text for part in content)
        message = {"role": template_role(self.role), "content": content or ""}
        if self.tool_calls:
            if self.role != "assistant":
                raise ParamError(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {self.role}")
            message["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{i}]")
                                     for i, call in enumerate(self.tool_calls)]
        if self.role == "function" and not self.name:
            raise ParamError(f"{where}.name", "a function message needs the name of the function whose result it is")
        if self.role == "tool":
            if not self.tool_call_id:
                raise ParamError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _template_call(call: ToolCall, where: str) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": parse_arguments(call.function.arguments, where)}}


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [m.as_template_message(f"messages[{i}]") for i, m in enumerate(messages)]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool = True

    prompt_logprobs: int | None = None  # vLLM's: the chat-templated prompt's, in the response (not streamed)
    # vLLM's: the template's assistant header after the messages (default), or the final assistant
    # message continued as it is (a prefill: the reply starts where its text ends)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the template (enable_thinking, ...)
    # OpenAI's; as vLLM, a variable of the chat template (gpt-oss's and others read it), with
    # enable_thinking unless "none" where chat_template_kwargs does not set it (Qwen 3's, Gemma's read that)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    echo: bool = False  # vLLM's: the reply's content starts with the final message's, when that is the assistant's

    def echoed(self) -> str:
        """The text `echo` puts before each choice's content: the final message's, when it has the
        reply's role (assistant), as vLLM's; else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return last.as_template_message()["content"]

    def usable_tools(self) -> list[tuple[int, Tool]]:
        """The tools the model may call, each with its place in `tools`: all of them, or those an
        allowed_tools choice names (ParamError naming one that is not a tool)."""
        tools = list(enumerate(self.tools or ()))
        if not isinstance(self.tool_choice, AllowedToolsChoice):
            return tools
        names = [tool.function.name for _, tool in tools]
        allowed = []
        for i, named in enumerate(self.tool_choice.allowed_tools.tools):
            if named.function.name not in names:
                raise ParamError(f"tool_choice.allowed_tools.tools[{i}].function.name",
                                 f"{named.function.name!r} is not one of the tools ({', '.join(names)})")
            allowed.append(names.index(named.function.name))
        return [tools[i] for i in sorted(set(allowed))]

    def template_kwargs(self) -> dict | None:
        """The chat template's variables: `chat_template_kwargs`, and `reasoning_effort` (see above)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        effort = {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}
        return effort | (self.chat_template_kwargs or {}) | {"reasoning_effort": self.reasoning_effort}

    def template_ending(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message), checked as vLLM does."""
        return template_ending(self.messages, self.add_generation_prompt, self.continue_final_message)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_prompt_logprobs(self) -> int | None:
        if _top_count("prompt_logprobs", self.prompt_logprobs) is None:
            return None
        if self.stream:
            raise ParamError("prompt_logprobs", "is not available with stream (as vLLM)")
        return self.prompt_logprobs

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            _top_count("top_logprobs", self.top_logprobs)
            if not self.logprobs:
                raise ParamError("top_logprobs", "requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, returned in each choice's `prompt_logprobs`
    tools: list[dict] | None = None     # chat completions only: named in a 400 here
    tool_choice: str | dict | None = None

    def reject_unimplemented(self) -> None:
        choice = None if self.tool_choice == "none" else self.tool_choice
        for name, value in (("tools", self.tools), ("tool_choice", choice)):
            if value is not None:
                raise ParamError(name, "is for /v1/chat/completions; completions have no tools")
        super().reject_unimplemented()

    def requested_logprobs(self) -> int | None:
        if self.suffix is not None:
            raise ParamError("suffix", "is not supported")
        return _top_count("logprobs", self.logprobs)

    def requested_prompt_logprobs(self) -> int | None:
        """With `echo`, `logprobs` covers the echoed prompt too (OpenAI's legacy completions)."""
        _top_count("prompt_logprobs", self.prompt_logprobs)
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def requested_max_tokens(self) -> int:
        """What the engine generates: `max_tokens: 0` (echo only) generates one token, left out of the reply."""
        if self.max_tokens is None:
            return 16
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.echo):
            raise ParamError("max_tokens", f"must be >= 1 (0 only with echo: the prompt alone), got {self.max_tokens}")
        return max(self.max_tokens, 1)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ParamError("prompt", "must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


def template_ending(messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool) -> tuple[bool, bool]:
    if continue_final_message:
        if add_generation_prompt:
            raise ParamError("continue_final_message", "cannot be true with add_generation_prompt (as vLLM): "
                                                       "set add_generation_prompt to false")
        if messages[-1].role != "assistant" or not messages[-1].content:
            raise ParamError("continue_final_message", "the final message must be an assistant message with text")
    return add_generation_prompt, continue_final_message


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # rendered by the chat template with the messages
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt; False for messages, whose
    # chat template writes its own (True adds the tokenizer's on top of the template's, as vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False  # vLLM's: the tokens' strings (their vocabulary pieces) as token_strs

    def special_tokens_added(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS): as asked, else vLLM's default."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


class RewardRequest(BaseModel):
    """POST /v1/rewards: one score per step from a process reward model. A field it does not have
    is a 400 naming it (as on /v1/search)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    question: str
    steps: list[str] = Field(min_length=1)


POOLING_UNSUPPORTED = {  # vLLM's /pooling fields that would change the answer: refused, never dropped
    "input": Unsupported("a reward model reads 'messages': a question (user) and its solution (assistant)"),
    "dimensions": Unsupported("a reward model's output is a score per step; it has no dimensions to cut"),
    "truncate_prompt_tokens": Unsupported("truncating would cut the question or steps; a conversation too long "
                                          "for the model is a 400"),
    "embed_dtype": Unsupported("base64 is float32", asks=lambda v: v not in (None, "float32")),
    "endianness": Unsupported("base64 is little-endian", asks=lambda v: v not in (None, "native", "little")),
}


class PoolingRequest(VendorRequest):
    """POST /pooling (vLLM's, for reward models): one conversation, a question (user) and its solution
    (assistant), the solution's steps split at the reward model's step separator; a score per step,
    as floats or (vLLM's `encoding_format: "base64"`) the base64 of their little-endian float32 bytes."""
    model_config = ConfigDict(extra="ignore", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = POOLING_UNSUPPORTED
    model: str
    messages: list[ChatMessage] = Field(min_length=2, max_length=2)
    step_separator: str | None = Field(default=None, min_length=1)  # default: the reward model's recipe's
    encoding_format: Literal["float", "base64"] = "float"


class ScoreRequest(BaseModel):
    """POST /v1/score: candidate continuations of one solution prefix, scored in one call (their shared
    prefix computed once, through the prefix cache and the score cache). A candidate is one step or
    several."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    question: str
    steps: list[str] = Field(default_factory=list)  # the prefix every candidate continues
    candidates: list[str | list[str]] = Field(min_length=1, max_length=1024)


class SearchRequest(BaseModel):
    """POST /v1/search: test-time search for one question (Search-and-Learn's parameters)."""
    # Every field of SearchConfig under its name there, with its default or None (the server chooses);
    # server/serving_search.py copies them across, tests/test_sampling_fields.py checks both. A field
    # it does not have is a 400 naming it: `max_iterations` for num_iterations, ignored, ran 40.
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None             # the generator; default: the first served model
    verifier: str | None = None          # the PRM; needed by every strategy but greedy and majority
    question: str | None = None
    messages: list[ChatMessage] | None = None  # alternative to question: system prompt + user question
    strategy: str = "beam"
    n: int = Field(default=4, ge=1, le=MAX_N)
    beam_width: int | None = None
    num_iterations: int = 40
    lookahead: int = 0
    temperature: float = 0.8
    top_p: float = 1.0
    max_tokens: int = 2048
    agg_strategy: str | None = None      # default: the verifier's declared aggregation, else "last"
    filter_duplicates: bool = False
    sort_completed: bool = False
    eos_sampling_at_max_depth: bool = False
    system_prompt: str | None = None
    seed: int = 0
    stream: bool = False                 # Server-Sent Events: progress events, then the result
    stream_options: dict | None = None   # (taken with no effect: usage is in the result; a gateway sends it)
    user: str | None = None              # (OpenAI's end-user id: no effect)
    # speculative decoding of the samples, as vLLM's speculative_config ({"method": "suffix", ...}): the
    # problem's sibling sequences are the drafts' source; off unless given
    speculative_config: dict | None = None
