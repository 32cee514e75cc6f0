"""OpenAI's chat messages (request parts) and how chat templates read them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from treeserve.errors import ParamError
from treeserve.template_roles import template_role
from treeserve.tool_arguments import parse_arguments
from treeserve.wire.tools import ToolCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


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


def template_ending(messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool) -> tuple[bool, bool]:
    if continue_final_message:
        if add_generation_prompt:
            raise ParamError("continue_final_message", "cannot be true with add_generation_prompt (as vLLM): "
                                                       "set add_generation_prompt to false")
        if messages[-1].role != "assistant" or not messages[-1].content:
            raise ParamError("continue_final_message", "the final message must be an assistant message with text")
    return add_generation_prompt, continue_final_message
