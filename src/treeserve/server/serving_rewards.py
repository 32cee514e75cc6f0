"""Scoring with the served reward models outside a search: /v1/rewards (one solution's steps),
vLLM's /pooling (a conversation, its solution split at the model's step separator as a search's are), /v1/score
(candidate continuations of one prefix in one call) and vLLM's /score body on it (question and solution
pairs, each solution split as /pooling's, its score the step scores aggregated as a search ranks them).
Every route submits its items to the model's StepScorer on the engine loop as one ticket: steps already
scored come from the score cache, and the items' shared prefix is computed once (the prefix cache)."""
from __future__ import annotations

import base64
import contextlib
import time
import uuid

import numpy as np

from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.errors import ParamError
from treeserve.runtime.roles import not_a_verifier
from treeserve.runtime.scorer import StepScorer, given_question, given_steps
from treeserve.search.config import STEP_DELIMITER, declared_aggregation
from treeserve.search.tree import aggregate, split_steps
from treeserve.wire.errors import APIError, from_value_error
from treeserve.wire.rewards import PoolingRequest, RewardRequest, ScoreRequest
from treeserve.wire.score import VLLMScoreRequest


def step_separator(scorer: StepScorer) -> str:
    """Where a solution splits into steps for this reward model: its recipe's separator token, step
    tag or step delimiter."""
    recipe = scorer.recipe
    for name in ("separator", "step_tag", "step_delimiter"):
        if isinstance(getattr(recipe, name, None), str):
            return getattr(recipe, name)
    return STEP_DELIMITER  # (Search-and-Learn's, and the bundled generator's)


def sent_steps(steps: list[str], where: str) -> list[str]:
    """Steps as sent, read by the rule offline scoring follows too (runtime's `given_steps`: stripped);
    an empty one is a 400."""
    try:
        return given_steps(steps, where)
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def asked_question(question: str, where: str) -> str:
    """The question of a scoring request; an empty one (blank) is a 400 naming `where`, as a search's
    is: the step scores of an answer to no question say nothing."""
    try:
        return given_question(question, where)
    except ParamError as exc:
        raise from_value_error(exc) from None


def encoded(scores: list[float], encoding_format: str) -> list[float] | str:
    """vLLM's pooling data: the floats, or the base64 of their little-endian float32 bytes."""
    if encoding_format == "float":
        return scores
    return base64.b64encode(np.asarray(scores, dtype="<f4").tobytes()).decode("ascii")


class RewardServing:
    def __init__(self, engine: AsyncLLMEngine, scorers: dict[str, StepScorer]):
        self.engine, self.scorers = engine, scorers
        self.aggregations = {name: declared_aggregation(s.engine.model_dir) for name, s in scorers.items()}

    def scorer(self, model: str, param: str = "model") -> StepScorer:
        """The served verifier `model`'s scorer; a model not served as one is a 400 saying why."""
        scorer = self.scorers.get(model)
        if scorer is None:
            raise APIError(400, f"{param}: {not_a_verifier(model, list(self.scorers))}", param=param,
                           code="model_not_a_verifier")
        return scorer

    async def rewards(self, body: RewardRequest) -> dict:
        scorer = self.scorer(body.model)
        question = asked_question(body.question, "question")
        scores = (await self.score(scorer, [(question, sent_steps(body.steps, "steps"))]))[0]
        return {"object": "reward", "model": body.model, "recipe": scorer.recipe.name, "scores": scores}

    async def pooling(self, body: PoolingRequest) -> dict:
        scorer = self.scorer(body.model)
        user, assistant = body.messages
        if user.role != "user" or assistant.role != "assistant":
            raise APIError(400, "messages: a reward model reads one question (a user message) and its solution "
                                f"(an assistant message), got {user.role} then {assistant.role}", param="messages")
        question, solution = (m.as_template_message(f"messages[{i}]")["content"] for i, m in enumerate(body.messages))
        asked_question(question, "messages[0].content")
        steps = solution_steps(solution, body.step_separator or step_separator(scorer), "messages[1].content")
        scores = (await self.score(scorer, [(question, steps)], ["messages"]))[0]
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
                "data": [{"index": 0, "object": "pooling", "data": encoded(scores, body.encoding_format)}],
                "usage": _usage(scorer, [(question, steps)])}

    async def score_candidates(self, body: ScoreRequest) -> dict:
        scorer = self.scorer(body.model)
        asked_question(body.question, "question")
        prefix = sent_steps(body.steps, "steps")
        items = [(body.question, prefix + sent_steps([c] if isinstance(c, str) else c, f"candidates[{i}]"))
                 for i, c in enumerate(body.candidates)]
        for i, (_, steps) in enumerate(items):
            if len(steps) == len(prefix):
                raise APIError(400, f"candidates[{i}]: a candidate needs at least one step", param=f"candidates[{i}]")
        results = await self.score(scorer, items)
        data = [{"index": i, "object": "score", "score": scores[-1], "scores": scores[len(prefix):]}
                for i, scores in enumerate(results)]
        return {"object": "list", "model": body.model, "recipe": scorer.recipe.name,
                "prefix_scores": results[0][:len(prefix)], "data": data, "usage": _usage(scorer, items)}

    async def score_pairs(self, body: VLLMScoreRequest) -> dict:
        """vLLM's score body: each (question, solution) pair's solution split into steps at the model's
        separator; `score` is the step scores aggregated (the verifier's declared aggregation, else the
        last step's: what /v1/search ranks by), `scores` the step scores."""
        scorer = self.scorer(body.model)
        try:
            pairs = body.pairs()
        except ParamError as exc:
            raise from_value_error(exc) from exc
        pairs = [(asked_question(question, asked), solution, field) for question, asked, solution, field in pairs]
        separator = step_separator(scorer)
        items = [(question, solution_steps(solution, separator, field)) for question, solution, field in pairs]
        results = await self.score(scorer, items, [field for _, _, field in pairs])
        how = self.aggregations[body.model]
        data = [{"index": i, "object": "score", "score": aggregate(scores, how), "scores": scores}
                for i, scores in enumerate(results)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
                "data": data, "usage": _usage(scorer, items)}

    async def score(self, scorer: StepScorer, items: list[tuple[str, list[str]]],
                    fields: list[str] | None = None) -> list[list[float]]:
        """The items' step scores, as one ticket on the engine loop; a stream carries the answer back
        (or the engine's failure). A conversation the model cannot read is a 400 naming the field the
        item came from (`fields`, one per item; default: steps)."""
        try:
            for (question, steps), field in zip(items, fields or ["steps"] * len(items)):
                scorer.require_readable(question, steps, field)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        stream_id = self.engine.new_request_id("reward")
        stream = self.engine.open_stream(stream_id)

        def on_ready(ticket) -> None:
            self.engine.push(stream_id, ticket.results(), final=True)
        submitted: dict = {}  # the ticket, written on the engine thread (even if this waiter is cancelled first)

        def cancel_unready() -> None:
            ticket = submitted.get("ticket")
            if ticket is not None and not ticket.ready:
                scorer.cancel(ticket)
        try:
            await self.engine.run_job(lambda: submitted.setdefault("ticket", scorer.submit(items, on_ready=on_ready)))
            async for scores in self.engine.stream_items(stream, lambda item: True):
                return scores
        finally:
            self.engine.close_stream(stream_id)
            if not submitted.get("ticket") or not submitted["ticket"].ready:
                with contextlib.suppress(RuntimeError):  # (jobs run in order: after the submit, if it runs)
                    self.engine.post(cancel_unready)
        raise APIError(503, "the engine stopped before the scores were ready", code="engine_dead")


def solution_steps(solution: str, separator: str, field: str) -> list[str]:
    """A solution's steps, cut at `separator`; none is a 400 naming `field`."""
    steps = split_steps(solution, separator)
    if not steps:
        raise APIError(400, f"{field}: the solution has no steps", param=field)
    return steps


def _usage(scorer: StepScorer, items: list[tuple[str, list[str]]]) -> dict:
    """The tokens the reward model read (before the prefix cache: a shared prefix counts in every item)."""
    try:
        tokens = sum(len(built.token_ids) for built in scorer.build_many(items))
    except (ValueError, ParamError):
        tokens = 0
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
