"""OpenAI's tool definitions, tool choices, and an assistant's earlier calls (request parts)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
