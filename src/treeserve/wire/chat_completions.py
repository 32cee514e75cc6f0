"""POST /v1/chat/completions: the request body."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from treeserve.errors import ParamError
from treeserve.wire.chat_messages import ChatMessage, template_ending
from treeserve.wire.sampling_request import SamplingRequest, top_count
from treeserve.wire.tools import AllowedToolsChoice, NamedToolChoice, Tool


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
    # vLLM's: a Jinja template for this request in place of the model's, taken only by a server started
    # with --trust-request-chat-template (else a 400 naming it, as vLLM's); rendered sandboxed (HF's)
    chat_template: str | None = None
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
        if top_count("prompt_logprobs", self.prompt_logprobs) is None:
            return None
        if self.stream:
            raise ParamError("prompt_logprobs", "is not available with stream (as vLLM)")
        return self.prompt_logprobs

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            top_count("top_logprobs", self.top_logprobs)
            if not self.logprobs:
                raise ParamError("top_logprobs", "requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None
