"""POST /tokenize and /detokenize (vLLM's): the request bodies."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from treeserve.wire.chat_messages import ChatMessage
from treeserve.wire.tools import Tool


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
    chat_template: str | None = None  # (as a chat completion's)
    return_token_strs: bool = False  # vLLM's: the tokens' strings (their vocabulary pieces) as token_strs

    def special_tokens_added(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS): as asked, else vLLM's default."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]
