"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as a translation of chat
completions: `system`, the content blocks (text, `tool_use`, `tool_result`) and the tools become a
chat request; the chat reply becomes a message (text and `tool_use` blocks, Anthropic's stop reasons
and usage). Errors on these routes are in Anthropic's shape (wire/errors.py's `anthropic_error`)."""
from __future__ import annotations

import json
import uuid
from typing import ClassVar

from pydantic import ConfigDict, Field

from treeserve.errors import ParamError
from treeserve.wire.partial_json import partial_object
from treeserve.wire.unsupported import Unsupported, UnsupportedParamError, VendorRequest

# Anthropic's fields treeserve does not implement: a 400 saying so (wire/unsupported.py), unless sent empty
MESSAGES_UNSUPPORTED = {
    "container": Unsupported("code execution containers: no server tools run here"),
    "mcp_servers": Unsupported("MCP servers: no server tools run here; give the tools as client tools"),
    "context_management": Unsupported("server-side context editing; send the conversation as it should be read"),
    "compaction": Unsupported("compaction requests"),
    "diagnostics": Unsupported("request diagnostics"),
    "fallbacks": Unsupported("fallback models; the gateway's model fallbacks are configured, not asked for"),
}

class ThreadUnsupported(ParamError):
    """`thread` (server-held conversations): refused in the form Anthropic's clients read, so that the
    tool runner (which asks for a thread) sends the whole conversation instead."""
    code = "thread_unsupported_request"


class CountTokensRequest(VendorRequest):
    """POST /v1/messages/count_tokens; content blocks are checked one by one (`chat_messages`). A
    field Anthropic does not know is a 400 naming it, as Anthropic's; one it knows and treeserve does
    not implement (MESSAGES_UNSUPPORTED) a 400 saying so."""
    model_config = ConfigDict(extra="forbid", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = MESSAGES_UNSUPPORTED
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None  # (its `format`: structured outputs, through the grammar engine)
    cache_control: dict | None = None  # (Anthropic's automatic caching: the prefix cache is always on here)
    speed: str | None = None  # (no effect here)

    def chat_fields(self) -> dict:
        if self.thinking and self.thinking.get("type") == "enabled":
            raise UnsupportedParamError("thinking", "extended thinking: the served models do not think apart from "
                                                    "their answer")
        body: dict = {"model": self.model, "messages": chat_messages(self.system, self.messages)}
        output_format(self.output_config or {})  # (checked here: a schema does not change the prompt's tokens)
        last = body["messages"][-1]
        if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
            # a prefill, as Anthropic's: the reply continues the final assistant text (no new turn)
            body.update(add_generation_prompt=False, continue_final_message=True)
        if self.tools:
            body["tools"] = [chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(chat_tool_choice(self.tool_choice))
        return body


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None
    # Anthropic's, taken with no effect here: priority tiers, where it runs
    service_tier: str | None = None
    inference_geo: str | None = None
    thread: dict | None = None  # (refused: ThreadUnsupported)

    def chat_request(self) -> dict:
        """The chat completions body; ParamError naming the Messages field for what cannot be translated."""
        if self.thread is not None:
            raise ThreadUnsupported("thread", "server-held conversations (threads) are not supported here; send "
                                              "the whole conversation without thread")
        body = self.chat_fields() | {"max_tokens": self.max_tokens} | output_format(self.output_config or {})
        for ours, chat in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("top_k", "top_k")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        user = (self.metadata or {}).get("user_id")
        if isinstance(user, str):
            body["user"] = user
        if self.stream:
            # (usage in every chunk: the first one's prompt tokens go in message_start, as Anthropic's)
            body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
        return body


def output_format(config: dict) -> dict:
    """The chat fields for `output_config` (`messages.parse(output_format=...)` sends its `format`):
    a JSON schema the reply follows, as Anthropic's structured outputs; `effort` other than the
    default is a 400 (the served models do not think apart from their answer)."""
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise ParamError(f"output_config.{unknown[0]}", "unknown parameter")
    if config.get("effort") not in (None, "high"):
        raise UnsupportedParamError("output_config.effort", "effort: the served models do not reason apart from "
                                                            "their answer; leave it out")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ParamError("output_config.format", "must be {type: json_schema, schema: {...}}")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def chat_messages(system: str | list[dict] | None, messages: list[dict]) -> list[dict]:
    chat = [{"role": "system", "content": _blocks_text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ParamError(f"{where}.role", f"must be user or assistant, got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif isinstance(content, list):
            chat += (_user_turn if role == "user" else _assistant_turn)(content, f"{where}.content")
        else:
            raise ParamError(f"{where}.content", "must be a string or a list of content blocks")
    return chat


def _user_turn(blocks: list, where: str) -> list[dict]:
    """Tool results first (as tool messages, in order), then the user's text."""
    tools, texts = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ParamError(f"{where}[{j}].tool_use_id", "this field is required (a string)")
            text = _blocks_text(block.get("content") or "", f"{where}[{j}].content")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
        else:
            raise ParamError(f"{where}[{j}].type", f"user content blocks of type {kind!r} are not supported "
                                                   "(text and tool_result are)")
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts or not tools else [])


def _assistant_turn(blocks: list, where: str) -> list[dict]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ParamError(f"{where}[{j}]", "a tool_use block needs its id and name")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # another model's thinking: nothing the served models' templates render
        else:
            raise ParamError(f"{where}[{j}].type", f"assistant content blocks of type {kind!r} are not supported "
                                                   "(text and tool_use are)")
    message = {"role": "assistant", "content": "\n".join(texts) or None}
    return [message | {"tool_calls": calls} if calls else message]


def _kind(block, where: str) -> str | None:
    if not isinstance(block, dict):
        raise ParamError(where, "a content block must be an object")
    return block.get("type")


def _block_text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ParamError(f"{where}.text", "this field is required (a string)")
    return block["text"]


def _blocks_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(where, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if _kind(block, f"{where}[{j}]") != "text":
            raise ParamError(f"{where}[{j}].type", f"only text blocks are supported here, got {block.get('type')!r}")
        texts.append(_block_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def chat_tool(tool: dict, where: str) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise ParamError(f"{where}.type", f"only client tools (custom) are supported, got {tool.get('type')!r}")
    if not isinstance(tool.get("name"), str):
        raise ParamError(f"{where}.name", "this field is required (a string)")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: dict) -> dict:
    kind = choice.get("type")
    fields: dict = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        return fields | {"tool_choice": kind}
    if kind == "any":
        return fields | {"tool_choice": "required"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return fields | {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise ParamError("tool_choice", "must be {type: auto}, {type: any}, {type: none} or {type: tool, name}")


# ---- chat -> message ---------------------------------------------------------------------------
def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(chat_usage: dict | None) -> dict:
    chat_usage = chat_usage or {}
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    prompt = int(chat_usage.get("prompt_tokens") or 0)  # Anthropic's input_tokens leave out the cache's
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": int(chat_usage.get("completion_tokens") or 0)}


def stop(finish_reason: str | None, stop_reason, stop_sequences: list[str] | None,
         called: bool = False) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a choice's finish; `called`: the reply has tool
    calls (`tool_use`, a named choice's too, whose chat finish is `stop`)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def tool_input(arguments: str) -> dict:
    """A tool_use block's `input`: the call's arguments as an object; those max_tokens cut, as far as
    they went (as Anthropic's SDK reads the streamed block's `partial_json`: the stream and the whole
    reply agree)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return partial_object(arguments)
    return value if isinstance(value, dict) else {}


def skeleton(model: str) -> dict:
    return {"id": new_message_id(), "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(None)}


def from_chat(request: MessagesRequest, model: str, chat: dict) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                 "input": tool_input(call["function"]["arguments"])} for call in message.get("tool_calls") or ()]
    reason, sequence = stop(choice.get("finish_reason"), choice.get("stop_reason"), request.stop_sequences,
                            bool(message.get("tool_calls")))
    return skeleton(model) | {"content": content, "stop_reason": reason, "stop_sequence": sequence,
                              "usage": usage(chat.get("usage"))}

