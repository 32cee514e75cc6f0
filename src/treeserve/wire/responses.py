"""OpenAI's Responses API (`/v1/responses`) as a translation of chat completions: a request's items
become a chat request's messages (after the stored history its `previous_response_id` names), and
the chat reply becomes the response's output items. The server and the gateway both speak it this
way (wire/responses_api.py), so a response reads the same wherever it was made."""
from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from treeserve.errors import ParamError
from treeserve.wire.metadata import Metadata
from treeserve.wire.unsupported import Unsupported, UnsupportedParamError, VendorRequest


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    format: TextFormat | None = None


def _reasons(reasoning) -> bool:
    """Whether `reasoning` asks for any (an effort of none or minimal, or none named, does not)."""
    return reasoning is not None and not (isinstance(reasoning, dict)
                                          and reasoning.get("effort") in (None, "none", "minimal"))


# OpenAI's fields treeserve does not implement: a 400 saying so (wire/unsupported.py), unless sent empty
RESPONSES_UNSUPPORTED = {
    "background": Unsupported("background responses; use stream, or the Batch API"),
    "background_options": Unsupported("background responses; use stream, or the Batch API"),
    "context_management": Unsupported("server-side compaction; use truncation: auto, or send a shorter input"),
    "include": Unsupported("extra output data such as logprobs or encrypted reasoning"),
    "prompt": Unsupported("stored prompt templates; send the input and instructions"),
    "top_logprobs": Unsupported("log probabilities in responses; chat completions' logprobs and top_logprobs "
                                "return them"),
    "reasoning": Unsupported("reasoning effort: the served models do not reason apart from their answer",
                             asks=_reasons),
    "moderation": Unsupported("moderation of input and output"),
    "image": Unsupported("image options: only text is served"),
    "access_programs": Unsupported("access programs"),
}


class ResponsesRequest(VendorRequest):
    """POST /v1/responses. Items are checked one by one (`chat_messages`), so an error names the item.
    A field OpenAI does not know is a 400 naming it, as OpenAI's (a chat completions habit such as
    `max_tokens`, silently ignored, let a response run to the model's length); one it knows and
    treeserve does not implement (RESPONSES_UNSUPPORTED) a 400 saying so."""
    model_config = ConfigDict(extra="forbid", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = RESPONSES_UNSUPPORTED
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # (OpenAI's range)
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict | None = None  # a conversation's id, or {"id": ...} (wire/conversations.py)
    metadata: Metadata | None = None  # (OpenAI's bounds: wire/metadata.py)
    user: str | None = None
    seed: int | None = None  # (not OpenAI's: treeserve's, as in chat completions)
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI's, taken with no effect here: serving tiers, prompt caching keys and retention (prefix
    # caching is automatic), abuse-monitoring ids, a cap on built-in tool calls (none run here), stream obfuscation
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict | None = None
    priority: int = Field(default=0, ge=0, le=1)  # (vLLM's: 1 waits behind every interactive request)


class InputTokensRequest(VendorRequest):
    """POST /v1/responses/input_tokens (`client.responses.input_tokens.count`): the fields of a response
    that make its prompt; the count is the `input_tokens` a response with them is charged."""
    model_config = ConfigDict(extra="forbid", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        name: RESPONSES_UNSUPPORTED[name] for name in ("context_management", "reasoning")}
    model: str | None = None
    input: str | list[dict] | None = None
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def as_response(self) -> ResponsesRequest:
        """The response request these fields make (validated already: the same types)."""
        fields = {name: getattr(self, name) for name in type(self).model_fields if getattr(self, name) is not None}
        return ResponsesRequest.model_construct(**(fields | {"input": self.input if self.input is not None else []}))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def conversation_id_of(conversation: str | dict) -> str:
    """A Responses request's `conversation`: its id, or `{"id": ...}`."""
    if isinstance(conversation, str):
        return conversation
    if isinstance(conversation.get("id"), str):
        return conversation["id"]
    raise ParamError("conversation.id", "this field is required (a string): the conversation's id")


ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_item(item: dict, suffix: str) -> dict:
    """An input item as OpenAI's input_items list shows it: typed, with an id (its own, or its kind's
    prefix and `suffix`) and a status, and a message's content as parts (`input_text`; an assistant's
    `output_text`), however it was sent."""
    kind = item.get("type", "message" if "role" in item else None)
    shown = dict(item, type=kind, id=item.get("id") or f"{ITEM_ID_PREFIXES.get(kind, 'item')}_{suffix}",
                 status=item.get("status") or "completed")
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        shown["content"] = [{"type": part, "text": item["content"]} | ({"annotations": []} if part == "output_text"
                                                                         else {})]
    return shown


# ---- request -> chat ---------------------------------------------------------------------------
def chat_request(request: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completions body for a Responses request after `history` (the chat messages of the
    responses it follows); ParamError naming the Responses field for what cannot be translated."""
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else [])
    messages += history + input_messages(request.input)
    body: dict = {"messages": messages}
    if request.model is not None:
        body["model"] = request.model
    for ours, chat in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                       ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"), ("seed", "seed")):
        if getattr(request, ours) is not None:
            body[chat] = getattr(request, ours)
    if request.priority:
        body["priority"] = request.priority
    if request.tools:
        body["tools"] = [chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(request.tool_choice)
    if request.text is not None and request.text.format is not None:
        body["response_format"] = response_format(request.text.format)
    if request.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def input_messages(items: str | list[dict], field: str = "input") -> list[dict]:
    """Chat messages for a request's `input` (or a conversation's `items`: `field` names them in errors):
    a string is one user message; items in order, calls joined to the assistant turn before them,
    outputs as tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                             "content": _content_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning summary (no model served here writes one): nothing a template renders
        else:
            raise ParamError(f"{where}.type", f"items of type {kind!r} are not supported (message, function_call, "
                                              "function_call_output are)")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ParamError(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
    return {"role": role, "content": _content_text(item.get("content"), f"{where}.content")}


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ParamError(f"{where}[{j}].type", f"only text parts are supported (input_text, output_text), "
                                                   f"got {kind!r}")
        if not isinstance(part.get("text"), str):  # (a text part without its text: not a part of another type)
            raise ParamError(f"{where}[{j}].text", f"this field is required (a string) in a part of type {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)  # (as a chat message's parts, and vLLM's)


def _text(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ParamError(f"{where}.{name}", "this field is required (a string)")
    return value


# the tool types OpenAI's Responses API defines besides `function` (served here: none of them)
OPENAI_TOOL_TYPES = ("file_search", "web_search", "web_search_preview", "web_search_2025_08_26",
                     "web_search_preview_2025_03_11", "computer_use_preview", "computer", "mcp", "code_interpreter",
                     "image_generation", "local_shell", "shell", "custom", "apply_patch", "namespace", "tool_search")


class MissingParamError(ParamError):
    code = "missing_required_parameter"


def chat_tool(tool: dict, where: str) -> dict:
    kind = tool.get("type")
    if kind in OPENAI_TOOL_TYPES:
        raise UnsupportedParamError(f"{where}.type", f"tools of type {kind!r}: only function tools are served")
    if kind != "function":
        raise ParamError(f"{where}.type", f"Invalid value: {kind!r}. Supported values are: 'function' (and OpenAI's "
                                          "built-in tools, which treeserve does not serve)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    if "name" not in function:
        raise ParamError(f"{where}.name", "this field is required")
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools":  # (chat completions' form of it: the function's name nested)
        tools = choice.get("tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise ParamError("tool_choice.tools", "must be a list of {type: function, name}")
        named = [{"type": "function", "function": {"name": tool["name"]}} for tool in tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": named}}
    raise ParamError("tool_choice", "must be none, auto, required, {type: function, name} or "
                     "{type: allowed_tools, mode, tools}")


def response_format(format: TextFormat) -> dict:
    if format.type != "json_schema":
        return {"type": format.type}
    if format.json_schema is None:
        raise MissingParamError("text.format.schema", "type json_schema needs a schema")
    if format.name is None:  # (OpenAI's: the name is required with json_schema)
        raise MissingParamError("text.format.name", "this field is required with type json_schema")
    return {"type": "json_schema", "json_schema": {"name": format.name or "response", "schema": format.json_schema,
                                                   "strict": format.strict}}


# ---- chat -> response --------------------------------------------------------------------------
def skeleton(request: ResponsesRequest, response_id: str, model: str) -> dict:
    """The response object before its output: what `response.created` carries."""
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format \
        else {"type": "text"}
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "conversation": {"id": conversation_id_of(request.conversation)} if request.conversation else None,
            "temperature": request.temperature,
            "top_p": request.top_p, "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
            "text": {"format": fmt}, "truncation": request.truncation or "disabled", "store": request.store,
            "metadata": request.metadata or {}, "user": request.user, "usage": None}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    # (cache_write_tokens is required by OpenAI's types; written blocks are not counted apart, as Messages'
    # cache_creation_input_tokens)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def item_status(finish_reason: str | None) -> str:
    """The status of the last output item: `incomplete` when max_output_tokens cut it, as OpenAI's."""
    return "incomplete" if finish_reason == "length" else "completed"


def finished(response: dict, finish_reason: str | None, usage: dict | None) -> dict:
    """The response with its status (incomplete when max_output_tokens cut it) and usage."""
    response = dict(response, usage=response_usage(usage))
    if finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        response["status"] = "completed"
    return response


def from_chat(response: dict, chat: dict) -> dict:
    """A whole chat reply as the response's output items."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content") or not message.get("tool_calls"):
        output.append(message_item(message.get("content") or ""))
    for call in message.get("tool_calls") or ():
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    output[-1]["status"] = item_status(choice.get("finish_reason"))
    return finished(dict(response, output=output), choice.get("finish_reason"), chat.get("usage"))


def assistant_message(output: list[dict]) -> dict:
    """The response's output as the chat message a later turn's history holds."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def conversation(history: list[dict], chat_body: dict, response: dict, instructions: str | None) -> list[dict]:
    """What a response stores for the next one (`previous_response_id`): the messages so far, without
    its own instructions (OpenAI's rule: they do not carry over), and its answer."""
    messages = chat_body["messages"][1:] if instructions else chat_body["messages"]
    return messages + [assistant_message(response["output"])]

