"""POST /v1/rewards, /pooling (vLLM's) and /v1/score: the request bodies of process reward scoring."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from treeserve.wire.chat_messages import ChatMessage
from treeserve.wire.unsupported import Unsupported, VendorRequest


class RewardRequest(BaseModel):
    """POST /v1/rewards: one score per step from a process reward model. A field it does not have
    is a 400 naming it (as on /v1/search)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # (as vLLM's: left out, the one reward model served)
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
    model: str | None = None  # (as vLLM's: left out, the one reward model served)
    messages: list[ChatMessage] = Field(min_length=2, max_length=2)
    step_separator: str | None = Field(default=None, min_length=1)  # default: the reward model's recipe's
    encoding_format: Literal["float", "base64"] = "float"


class ScoreRequest(BaseModel):
    """POST /v1/score: candidate continuations of one solution prefix, scored in one call (their shared
    prefix computed once, through the prefix cache and the score cache). A candidate is one step or
    several."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # (as vLLM's: left out, the one reward model served)
    question: str
    steps: list[str] = Field(default_factory=list)  # the prefix every candidate continues
    candidates: list[str | list[str]] = Field(min_length=1, max_length=1024)
