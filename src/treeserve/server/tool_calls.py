"""Tool calling for one chat request: which calls are allowed or forced, the grammar that forces
them, and the reply's `tool_calls` (whole, or as OpenAI's streamed deltas).

`tool_choice`: `none` renders the tools in the prompt and reads no calls; `auto` (the default
when tools are given and the server has a parser) reads calls written in the parser's format;
`required` and a named function constrain the output with the grammar engine to calls of the
allowed functions, in the parser's format (a JSON array of calls on a server with no parser).
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from treeserve.errors import ParamError
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams
from treeserve.server.tool_parsers import FORCED_FORMAT, TOOL_CALL_FORMATS, Parsed, ToolCallFormat, finish, kept


@dataclass(frozen=True)
class ToolSettings:
    """The server's: `--tool-call-parser` and `--enable-auto-tool-choice` (vLLM's flags)."""
    parser: str | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in TOOL_CALL_FORMATS:
            raise ParamError("tool_call_parser", f"unknown parser {self.parser!r}; known: "
                             f"{', '.join(TOOL_CALL_FORMATS)}")
        if self.auto and self.parser is None:
            raise ParamError("enable_auto_tool_choice", "needs --tool-call-parser (the format to read calls in)")


def special_tokens(tokenizer) -> frozenset[str]:
    """The vocabulary's special tokens (added tokens marked special: never spelled by text)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    return frozenset(token.content for token in added if token.special)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalling:
    """One request's tools, choice and format."""

    def __init__(self, functions: list[dict], choice: str, format: ToolCallFormat, parallel: bool,
                 special_tokens: frozenset[str] = frozenset(), indexes: list[int] | None = None):
        self.functions, self.choice, self.format, self.parallel = functions, choice, format, parallel
        self.special_tokens = special_tokens
        self.indexes = indexes or list(range(len(functions)))  # each function's place in the request's tools

    @classmethod
    def from_request(cls, request, settings: ToolSettings,
                     special_tokens: frozenset[str] = frozenset()) -> "ToolCalling | None":
        """None when the request has no tools (and so no choice); ParamError naming what is wrong.
        `special_tokens`: the model's vocabulary's (see `ToolCallFormat.grammar`)."""
        tools, choice = request.tools, request.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise ParamError("tool_choice", "is only allowed when tools are given")
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in tools]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ParamError("tools", f"function names must be unique, got {names}")
        if choice is None:
            choice = "auto" if settings.auto else "none"
        indexes = list(range(len(functions)))
        if getattr(choice, "type", None) == "allowed_tools":  # (the functions it names, in `mode`)
            indexes = [i for i, _ in request.usable_tools()]
            functions, choice = [functions[i] for i in indexes], choice.allowed_tools.mode
        if not isinstance(choice, str):
            if choice.function.name not in names:
                raise ParamError("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools "
                                 f"({', '.join(names)})")
            indexes = [names.index(choice.function.name)]
            functions, choice = [functions[indexes[0]]], "named"
        if choice == "auto" and not settings.auto:
            raise ParamError("tool_choice", '"auto" needs a server started with --enable-auto-tool-choice and '
                             "--tool-call-parser")
        forced = choice in ("required", "named")
        if forced and request.structured_spec() is not None:
            raise ParamError("tool_choice", f"{request.structured_param} cannot be combined with "
                             "a required or named tool choice (both constrain the output)")
        format = TOOL_CALL_FORMATS[settings.parser] if settings.parser else FORCED_FORMAT
        parallel = request.parallel_tool_calls and choice != "named"
        return cls(functions, choice, format, parallel, special_tokens, indexes)

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def structured_outputs(self, functions: list[dict] | None = None) -> StructuredOutputsParams | None:
        """The grammar of a forced choice: calls of these (default: the allowed) functions only."""
        if not self.forced:
            return None
        grammar = self.format.grammar(functions or self.functions, self.parallel, self.special_tokens)
        return StructuredOutputsParams(grammar=grammar)

    def adjust(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling as its tools need: a forced choice's grammar; the format's
        markers kept in the text where they are special tokens."""
        if self.forced:
            params = dataclasses.replace(params, structured_outputs=self.structured_outputs())
        if self.reads_calls and set(self.format.markers) & self.special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    def locate_schema_error(self, compile_grammar) -> ParamError | None:
        """Which function's parameters the grammar engine rejects (compiling each one alone)."""
        for index, function in zip(self.indexes, self.functions):
            try:
                compile_grammar(self.structured_outputs([function]))
            except ParamError as exc:
                return ParamError(f"tools[{index}].function.parameters", exc.detail)
        return None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The reply's message for a whole output, and its finish reason (`tool_calls` for calls)."""
        if not self.reads_calls:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = finish(self.format.parse(text, final=True), text, cut=finish_reason == "length")
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        message = {"role": "assistant", "content": parsed.content if parsed.content.strip() or not calls else None}
        if not calls:
            return message, finish_reason
        message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.final_arguments}} for c in calls]
        return message, self.finish_reason(finish_reason)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """A reply with calls ends `tool_calls`, but for a named choice, which ends `stop` as OpenAI's
        and vLLM's do (the caller asked for that call)."""
        return "tool_calls" if finish_reason == "stop" and self.choice != "named" else finish_reason


class ToolCallStream:
    """One streamed choice: text in, then the content and OpenAI's tool-call deltas to send. A call
    is announced (index, id, type, name, and its arguments so far) once its name is complete; its
    arguments follow in fragments as the model writes them. A complete call with no name is never
    one and is passed over."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.text = ""
        self.content_sent = 0
        self.announced: dict[int, list] = {}  # position among the parsed calls -> [index, id, arguments sent]
        self.scans: dict = {}  # the calls' scans, each going on from where the last text ended

    def feed(self, delta: str, final: bool, cut: bool = False) -> tuple[str, list[dict]]:
        """`cut`: max_tokens ended the text (with `final`; a call it cut is still one, see `kept`)."""
        if not delta and not final:
            return "", []
        self.text += delta
        parsed = self.calling.format.parse(self.text, final, self.scans)
        if final and not self.announced and not any(kept(c, cut) for c in parsed.calls):
            parsed = Parsed(self.text)  # no call after all: everything held back is the answer
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        return content, self._call_deltas(parsed.calls)

    def _call_deltas(self, calls) -> list[dict]:
        deltas = []
        for position, call in enumerate(calls):
            if position not in self.announced:
                if call.name is None and call.complete:
                    continue  # never a call
                if call.name is None or (not self.calling.parallel and self.announced):
                    break  # its name is still to come (calls are announced in order), or one is all
                self.announced[position] = [len(self.announced), new_call_id(), 0]
                index, call_id, _ = self.announced[position]
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            entry = self.announced[position]
            arguments = call.final_arguments
            if len(arguments) > entry[2]:
                fragment = arguments[entry[2]:]
                entry[2] = len(arguments)
                if deltas and deltas[-1]["index"] == entry[0]:  # one entry per call in a chunk
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": entry[0], "function": {"arguments": fragment}})
        return deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.calling.finish_reason(finish_reason) if self.announced else finish_reason
