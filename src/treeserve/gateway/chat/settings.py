"""A conversation's settings, sent with each message and kept with the conversation."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from treeserve.gateway.fields import Text


class ChatSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, max_length=128)
    mode: Literal["chat", "search", "tools"] = "chat"
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    max_tokens: int = Field(256, ge=1, le=8192)
    system_prompt: Text = Field("", max_length=8000)
    search_n: int = Field(4, ge=1, le=64)  # candidates a search keeps (its n)
    search_strategy: Literal["best_of_n", "weighted_best_of_n", "majority", "beam", "dvts"] = "beam"

    def sampling(self) -> dict:
        """The fields every model request carries."""
        return {"temperature": self.temperature, "top_p": self.top_p,
                "repetition_penalty": self.repetition_penalty, "max_tokens": self.max_tokens}


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: Text = Field(min_length=1, max_length=32000)
    settings: ChatSettings | None = None  # default: the conversation's


class RegenerateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    settings: ChatSettings | None = None  # default: the conversation's


class ConversationIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: Text | None = Field(None, max_length=400)
    settings: ChatSettings | None = None


class LoginIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Text = Field(min_length=1, max_length=128)
    password: Text = Field(min_length=1, max_length=1024)
