"""POST /v1/score (and vLLM's /score) in either of two bodies, told apart by their fields: treeserve's
(`question`, `steps`, `candidates`: candidate continuations of one solution prefix) and vLLM's, a pair
of fields of questions and solutions under any of the names vLLM's ScoreRequest takes (`text_1` and
`text_2`, `queries` and `documents` or `items`, `data_1` and `data_2`; each input as
wire/score_inputs.py reads it). For a process reward model a vLLM pair is a question and a whole
solution, paired 1:1, 1:N or N:N as vLLM pairs them. A body with fields of both, of two of vLLM's
pairs, or of neither, is a 400 naming one."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, RootModel

from treeserve.errors import ParamError
from treeserve.wire.rewards import ScoreRequest
from treeserve.wire.score_inputs import ScoreInputs, check_inputs, texts
from treeserve.wire.unsupported import Unsupported, VendorRequest

MAX_PAIRS = 1024  # (as treeserve's `candidates`)
TREESERVE_FIELDS = ("question", "steps", "candidates")
_TRUNCATES = "truncating would cut the question or solution; a pair too long for the model is a 400"

VLLM_SCORE_UNSUPPORTED = {  # vLLM's /score fields that would change the answer: refused, never dropped
    "truncate_prompt_tokens": Unsupported(_TRUNCATES, asks=lambda v: v is not None),
    "max_tokens_per_query": Unsupported(_TRUNCATES, asks=lambda v: v not in (None, 0)),
    "max_tokens_per_doc": Unsupported(_TRUNCATES, asks=lambda v: v not in (None, 0)),
    "truncation_side": Unsupported("nothing is truncated", asks=lambda v: v not in (None, "left", "right")),
    "padding": Unsupported("a pair is read as it is", asks=lambda v: v not in (None, "do_not_pad")),
    "cache_salt": Unsupported("the reward model's prefix cache is not salted per request"),
    "mm_processor_kwargs": Unsupported("the reward models read text only"),
    "use_activation": Unsupported("a step's score is the reward model's probability; there are no raw logits "
                                  "to return", asks=lambda v: v is False),
    "activation": Unsupported("as use_activation", asks=lambda v: v is False),
    "softmax": Unsupported("as use_activation", asks=lambda v: v is False),
    "priority": Unsupported("scoring has no priority scheduling", asks=lambda v: v not in (None, 0)),
}


class VLLMScoreRequest(VendorRequest):
    """vLLM's score body: questions and solutions in the two fields FIELDS names (a subclass each)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = VLLM_SCORE_UNSUPPORTED
    FIELDS: ClassVar[tuple[str, str]]
    model: str | None = None  # (vLLM's may be left out: the served reward model, where there is one)
    user: str | None = None  # (taken with no effect, as vLLM's)
    request_id: str | None = None  # (vLLM's; the server's own request id is in the x-request-id header)

    def pairs(self) -> list[tuple[str, str, str, str]]:
        """(question, its place, solution, its place) per pair, as vLLM pairs them: 1:1, 1:N, N:N."""
        first, second = self.FIELDS
        questions, solutions = texts(getattr(self, first), first), texts(getattr(self, second), second)
        if not questions:
            raise ParamError(first, "at least one text must be given")
        if not solutions:
            raise ParamError(second, "at least one text must be given")
        if len(questions) > 1 and len(questions) != len(solutions):
            raise ParamError(second, f"pairs are 1:1, 1:N or N:N; got {len(questions)} {first} and "
                                     f"{len(solutions)} {second}")
        if len(solutions) > MAX_PAIRS:
            raise ParamError(second, f"at most {MAX_PAIRS} texts, got {len(solutions)}")
        questions = questions * len(solutions) if len(questions) == 1 else questions
        return [(*question, *solution) for question, solution in zip(questions, solutions)]


class VLLMTextScoreRequest(VLLMScoreRequest):
    FIELDS: ClassVar[tuple[str, str]] = ("text_1", "text_2")
    text_1: ScoreInputs
    text_2: ScoreInputs


class VLLMQueriesDocumentsScoreRequest(VLLMScoreRequest):
    FIELDS: ClassVar[tuple[str, str]] = ("queries", "documents")
    queries: ScoreInputs
    documents: ScoreInputs


class VLLMQueriesItemsScoreRequest(VLLMScoreRequest):
    FIELDS: ClassVar[tuple[str, str]] = ("queries", "items")
    queries: ScoreInputs
    items: ScoreInputs


class VLLMDataScoreRequest(VLLMScoreRequest):
    FIELDS: ClassVar[tuple[str, str]] = ("data_1", "data_2")
    data_1: ScoreInputs
    data_2: ScoreInputs


VLLM_BODIES = (VLLMTextScoreRequest, VLLMQueriesDocumentsScoreRequest, VLLMQueriesItemsScoreRequest,
               VLLMDataScoreRequest)
VLLM_FIELDS = tuple(dict.fromkeys(name for body in VLLM_BODIES for name in body.FIELDS))
VLLM_PAIRS = ", ".join(" and ".join(body.FIELDS) for body in VLLM_BODIES)


class ScoreBody(RootModel[ScoreRequest | VLLMTextScoreRequest | VLLMQueriesDocumentsScoreRequest
                         | VLLMQueriesItemsScoreRequest | VLLMDataScoreRequest]):
    """/v1/score's body, for /openapi.json: treeserve's or one of vLLM's."""


def score_body_model(data: Any) -> type[BaseModel]:
    """Which body `data` (the parsed JSON) is, by its fields."""
    if not isinstance(data, dict):
        return ScoreRequest  # (its validation names what is wrong)
    ours = [name for name in TREESERVE_FIELDS if name in data]
    vllms = [name for name in VLLM_FIELDS if name in data]
    if ours and vllms:
        raise ParamError(vllms[0], f"is a field of vLLM's score body ({VLLM_PAIRS}) and {', '.join(ours)} of "
                                   "treeserve's (question, steps, candidates): send one or the other")
    if not ours and not vllms:
        raise ParamError("text_1", f"this field is required: send vLLM's score body (questions and solutions as "
                                   f"{VLLM_PAIRS}) or treeserve's (question, steps: a prefix, candidates)")
    if not vllms:
        return ScoreRequest
    body = _vllm_body(vllms)
    for name in body.FIELDS:
        check_inputs(data[name], name)
    return body


def _vllm_body(sent: list[str]) -> type[VLLMScoreRequest]:
    """The vLLM body whose pair of fields was sent (the one with most of them sent, the first of a tie:
    a field of another is a 400 naming it, a missing one of its pair a 400 naming that)."""
    body = max(VLLM_BODIES, key=lambda b: sum(name in sent for name in b.FIELDS))
    others = [name for name in sent if name not in body.FIELDS]
    if others:
        raise ParamError(others[0], f"is a field of another of vLLM's score bodies than {' and '.join(body.FIELDS)}: "
                                    f"send one pair of fields ({VLLM_PAIRS})")
    missing = [name for name in body.FIELDS if name not in sent]
    if missing:
        raise ParamError(missing[0], f"this field is required: vLLM's score body pairs {body.FIELDS[0]} (questions) "
                                     f"with {body.FIELDS[1]} (solutions)")
    return body
