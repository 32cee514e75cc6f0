"""Tool-call formats: where a model writes its calls in its text, how to read them back (also from a
stream that stops mid-call), and the grammar that makes a model write a call that validates.

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, after any text
  (Hermes, Qwen 2.5 and 3, and the models trained on their template);
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` objects separated by `;`,
  optionally after `<|python_tag|>` (Llama 3.1 and later with JSON tool calling);
- `json`: a JSON array of `{"name": ..., "parameters": {...}}` objects. Not a model's native
  format: what `required` and named choices make a model write on a server given no parser.

Every format reads either `arguments` or `parameters` as a call's arguments, and keeps them as the
model wrote them (the text of that JSON value), so the fragments a stream sends add up to the
arguments of the same text parsed whole.
"""
from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from treeserve.engine.json_schema_strict import strict_schema

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ParsedCall:
    name: str | None = None      # set once the name's JSON string is complete
    arguments: str = ""          # the arguments value's text so far
    complete: bool = False       # the call's object is closed
    text: str = ""               # the whole object's text, once complete

    @property
    def valid(self) -> bool:
        """A complete call whose object is JSON, with a name and arguments that are a JSON object."""
        if not (self.complete and self.name):
            return False
        whole, arguments = _loads(self.text), _loads(self.final_arguments)
        return isinstance(whole, dict) and isinstance(arguments, dict)

    @property
    def final_arguments(self) -> str:
        """A complete call that wrote no arguments takes none: `{}`."""
        return self.arguments if self.arguments or not self.complete else "{}"


@dataclass
class Parsed:
    content: str                                  # text that is not part of a call
    calls: list[ParsedCall] = field(default_factory=list)


def scan_object(text: str, start: int, scans: dict | None = None) -> tuple[ParsedCall, int | None]:
    """Reads the (maybe unfinished) JSON object at `text[start] == "{"` as a call: its `name` once
    complete, its arguments' text so far. Returns the call and the index after the object (None
    while it is open). `scans` (a stream's, over a text that only grows) keeps each object's scan
    to go on from where it stopped, so a stream reads each character once."""
    scan = scans.get(start) if scans is not None else None
    if scan is None:
        scan = _ObjectScan(start)
        if scans is not None:
            scans[start] = scan
    scan.advance(text)
    return scan.reading(text), scan.end


class _ObjectScan:
    """A character scan of one JSON object that notes where each top-level value starts and ends;
    it can stop at the end of the text and go on when there is more."""

    def __init__(self, start: int):
        self.pos, self.start, self.end = start, start, None
        self.depth, self.in_string, self.escaped = 0, False, False
        self.key_start: int | None = None
        self.key: str | None = None
        self.value_start: int | None = None
        self.call = ParsedCall()

    def reading(self, text: str) -> ParsedCall:
        """The call as far as the text goes (a copy: the scan's own stays as the scan left it)."""
        call = dataclasses.replace(self.call, complete=self.end is not None)
        if call.complete:
            call.text = text[self.start:self.end]
        elif self.value_start is not None and self.key in ARGUMENT_KEYS and not call.arguments:
            call.arguments = text[self.value_start:]  # the arguments so far
        return call

    def advance(self, text: str) -> None:
        i = self.pos
        while self.end is None and i < len(text):
            self._char(text, i)
            i += 1
        self.pos = i

    def _char(self, text: str, i: int) -> None:
        ch = text[i]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.key_start is not None:  # a key ends
                    self.key, self.key_start = _loads(text[self.key_start:i + 1]), None
                elif self.depth == 1 and self.value_start is not None:  # a top-level string value ends
                    self._close_value(text, i + 1)
            return
        if ch == '"':
            self.in_string = True
            if self.depth == 1 and self.value_start is None and self.key is None:
                self.key_start = i
            elif self.depth == 1 and self.value_start is None:
                self.value_start = i
        elif ch in "{[":
            if self.depth == 1 and self.value_start is None and self.key is not None:
                self.value_start = i
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.value_start is not None:
                self._close_value(text, i + 1)
            elif self.depth == 0:
                self._close_value(text, i)
                self.end = i + 1
        elif self.depth == 1 and ch == ",":
            self._close_value(text, i)
        elif self.depth == 1 and not ch.isspace() and ch != ":" and self.key is not None and self.value_start is None:
            self.value_start = i  # a number, true, false or null

    def _close_value(self, text: str, end: int) -> None:
        if self.value_start is None:
            return
        value = text[self.value_start:end].strip()
        if self.key == "name" and self.call.name is None:
            name = _loads(value)
            self.call.name = name if isinstance(name, str) else None
        elif self.key in ARGUMENT_KEYS and not self.call.arguments:
            self.call.arguments = value
        self.key, self.value_start = None, None


def _loads(text: str):
    """The JSON value, or None for what is not JSON (or nested past the parser's recursion limit)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back while
    streaming, until the next text says whether the marker came)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _scan_sequence(text: str, i: int, separators: str, calls: list[ParsedCall], scans: dict | None) -> None:
    """Objects from `text[i]` on, separated by one of `separators` (and spaces), until anything else."""
    while i < len(text) and text[i] == "{":
        call, end = scan_object(text, i, scans)
        calls.append(call)
        if end is None:
            return
        i = _skip_space(text, end)
        if i < len(text) and text[i] in separators:
            i = _skip_space(text, i + 1)
        else:
            return


class ToolCallFormat(ABC):
    """One way of writing calls: `parse` reads text (`final`: no more will come), `grammar` is the
    Lark grammar (for llguidance) that allows only calls of the given functions."""
    name: str
    arguments_key: str = "parameters"
    markers: tuple[str, ...] = ()  # text the format's calls are marked with (kept when special tokens)

    @abstractmethod
    def parse(self, text: str, final: bool, scans: dict | None = None) -> Parsed:
        """The content and calls of `text` so far (`scans`: see `scan_object`)."""

    def grammar(self, functions: list[dict], parallel: bool, special_tokens: frozenset[str] = frozenset()) -> str:
        """`special_tokens`: the vocabulary's special tokens; a marker that is one is written as
        that token (llguidance's `<name>`), as the model was trained to, not spelled in pieces."""
        rules = [f"call_{i}: %json {json.dumps(call_schema(f, self.arguments_key))}" for i, f in enumerate(functions)]
        body = " | ".join(f"call_{i}" for i in range(len(functions)))
        return "\n".join([self._start(parallel), f"call: {self._wrap(body, special_tokens)}", *rules]) + "\n"

    @abstractmethod
    def _start(self, parallel: bool) -> str:
        """The grammar's start rule: one call, or calls in sequence."""

    def _wrap(self, body: str, special_tokens: frozenset[str]) -> str:
        return f"({body})"


class HermesFormat(ToolCallFormat):
    name, arguments_key = "hermes", "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)  # special tokens in some vocabularies, plain text in others

    def parse(self, text: str, final: bool, scans: dict | None = None) -> Parsed:
        """The content is the text before the first tag that opens a call (a tag mentioned in
        passing, not followed by an object, stays in it); the calls follow."""
        calls, content_end, start = [], None, text.find(self.OPEN)
        while start >= 0:
            i = _skip_space(text, start + len(self.OPEN))
            if i < len(text) and text[i] != "{":
                start = text.find(self.OPEN, i)
                continue
            content_end = start if content_end is None else content_end
            if i == len(text):
                break  # what follows the tag is still to come
            call, end = scan_object(text, i, scans)
            calls.append(call)
            if end is None:
                break
            start = text.find(self.OPEN, end)
        if content_end is None:
            return Parsed(text[:len(text) - (0 if final else _held(text, self.OPEN))])
        return Parsed(text[:content_end], calls)

    def _start(self, parallel: bool) -> str:
        return 'start: call ("\\n" call)*' if parallel else "start: call"

    def _wrap(self, body: str, special_tokens: frozenset[str]) -> str:
        def marker(text: str) -> str:
            return text if text in special_tokens else f'"{text}"'
        return f'{marker(self.OPEN)} "\\n" ({body}) "\\n" {marker(self.CLOSE)}'


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool, scans: dict | None = None) -> Parsed:
        i = _skip_space(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = _skip_space(text, i + len(self.PYTHON_TAG))
        rest = text[i:]
        if not final and (not rest or self.PYTHON_TAG.startswith(rest)):
            return Parsed("")  # nothing yet says whether this is a call or an answer
        if not rest.startswith("{"):
            return Parsed(text)
        parsed = Parsed("")
        _scan_sequence(text, i, ";", parsed.calls, scans)
        return parsed

    def _start(self, parallel: bool) -> str:
        return 'start: call ("; " call)*' if parallel else "start: call"


class JsonArrayFormat(ToolCallFormat):
    name = "json"

    def parse(self, text: str, final: bool, scans: dict | None = None) -> Parsed:
        i = _skip_space(text, 0)
        if i == len(text) and not final:
            return Parsed("")
        if not text.startswith("[", i):
            return Parsed(text)
        parsed = Parsed("")
        _scan_sequence(text, _skip_space(text, i + 1), ",", parsed.calls, scans)
        return parsed

    def _start(self, parallel: bool) -> str:
        return 'start: "[" call ("," call)* "]"' if parallel else 'start: "[" call "]"'


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}
FORCED_FORMAT = JsonArrayFormat()


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: none given


def call_schema(function: dict, arguments_key: str) -> dict:
    """The JSON schema of one call of `function` ({"name", "parameters"} as in a request's tools):
    its name, then arguments valid for its parameters, in strict mode as every JSON schema (an
    object takes only the keys it lists unless it says otherwise: `engine/json_schema_strict.py`).
    The parameters' `$defs` move to the root, where their `#/$defs/...` references point."""
    parameters = strict_schema(function.get("parameters") or NO_PARAMETERS)
    defs = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}, **defs}


def kept(call: ParsedCall, cut: bool) -> bool:
    """Whether the final reading keeps a call: one that validates, or, when max_tokens `cut` the text,
    the call it cut once its name was read (its arguments unfinished), as a stream announced it and as
    OpenAI's reply (`length`, arguments cut short) and Anthropic's (`max_tokens`, the tool_use block
    incomplete) keep it."""
    return call.valid or (cut and call.name is not None and not call.complete)


def finish(parsed: Parsed, text: str, cut: bool = False) -> Parsed:
    """The final reading: the calls kept (see `kept`); with none, the whole text is the answer."""
    calls = [c for c in parsed.calls if kept(c, cut)]
    if not calls:
        return Parsed(text)
    return Parsed(parsed.content, calls)
