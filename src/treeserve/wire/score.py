"""POST /v1/score (and vLLM's /score) in either of two bodies, told apart by their fields: treeserve's
(`question`, `steps`, `candidates`: candidate continuations of one solution prefix) and vLLM's
(`text_1`, `text_2`: text pairs). For a process reward model a vLLM pair is a question (`text_1`) and a
whole solution (`text_2`), paired 1:1, 1:N or N:N as vLLM pairs them. A body with fields of both, or
of neither, is a 400 naming them."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, RootModel

from treeserve.errors import ParamError
from treeserve.wire.rewards import ScoreRequest
from treeserve.wire.unsupported import Unsupported, VendorRequest

MAX_PAIRS = 1024  # (as treeserve's `candidates`)
TREESERVE_FIELDS = ("question", "steps", "candidates")
VLLM_FIELDS = ("text_1", "text_2")

VLLM_SCORE_UNSUPPORTED = {  # vLLM's /score fields that would change the answer: refused, never dropped
    "truncate_prompt_tokens": Unsupported("truncating would cut the question or solution; a pair too long for "
                                          "the model is a 400", asks=lambda v: v is not None),
    "mm_processor_kwargs": Unsupported("the reward models read text only"),
    "use_activation": Unsupported("a step's score is the reward model's probability; there are no raw logits "
                                  "to return", asks=lambda v: v is False),
    "activation": Unsupported("as use_activation", asks=lambda v: v is False),
    "softmax": Unsupported("as use_activation", asks=lambda v: v is False),
    "priority": Unsupported("scoring has no priority scheduling", asks=lambda v: v not in (None, 0)),
}


class VLLMScoreRequest(VendorRequest):
    """vLLM's score body: `text_1` (questions) and `text_2` (solutions), each a string or a list."""
    model_config = ConfigDict(extra="forbid", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = VLLM_SCORE_UNSUPPORTED
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None  # (taken with no effect, as vLLM's)
    request_id: str | None = None  # (vLLM's; the server's own request id is in the x-request-id header)

    def pairs(self) -> list[tuple[str, str, str]]:
        """(question, solution, the solution's field) per pair, as vLLM pairs them: 1:1, 1:N, N:N."""
        questions = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        solutions = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not questions:
            raise ParamError("text_1", "at least one text must be given")
        if not solutions:
            raise ParamError("text_2", "at least one text must be given")
        if len(questions) > 1 and len(questions) != len(solutions):
            raise ParamError("text_2", f"pairs are 1:1, 1:N or N:N; got {len(questions)} text_1 and "
                                       f"{len(solutions)} text_2")
        if len(solutions) > MAX_PAIRS:
            raise ParamError("text_2", f"at most {MAX_PAIRS} texts, got {len(solutions)}")
        questions = questions * len(solutions) if len(questions) == 1 else questions
        fields = ["text_2"] if isinstance(self.text_2, str) else [f"text_2[{i}]" for i in range(len(solutions))]
        return list(zip(questions, solutions, fields))


class ScoreBody(RootModel[ScoreRequest | VLLMScoreRequest]):
    """/v1/score's body, for /openapi.json: treeserve's or vLLM's."""


def score_body_model(data: Any) -> type[BaseModel]:
    """Which body `data` (the parsed JSON) is, by its fields."""
    if not isinstance(data, dict):
        return ScoreRequest  # (its validation names what is wrong)
    ours = [name for name in TREESERVE_FIELDS if name in data]
    vllms = [name for name in VLLM_FIELDS if name in data]
    if ours and vllms:
        raise ParamError(vllms[0], f"is vLLM's score body (text_1, text_2) and {', '.join(ours)} treeserve's "
                                   "(question, steps, candidates): send one or the other")
    if not ours and not vllms:
        raise ParamError("text_1", "this field is required: send vLLM's score body (text_1: questions, text_2: "
                                   "solutions) or treeserve's (question, steps: a prefix, candidates)")
    if vllms:
        _require_text_items(data)
    return VLLMScoreRequest if vllms else ScoreRequest


def _require_text_items(data: dict) -> None:
    """A list of texts holding something else is a 400 naming the item (pydantic's union would name
    the field and say it should be a string, though it is a list)."""
    for name in VLLM_FIELDS:
        texts = data.get(name)
        for i, text in enumerate(texts if isinstance(texts, list) else []):
            if not isinstance(text, str):
                raise ParamError(f"{name}[{i}]", f"each text must be a string, got {json_type(text)}")


def json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)
