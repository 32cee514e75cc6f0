"""The server's routes: the operator's (health probes, version, metrics) and the OpenAI ones (models,
chat and completions, search, rewards and scores, tokenize), over `ServedModels`, which finds a request's
served model by its `model` field."""
from __future__ import annotations

import time
import uuid
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from treeserve import __version__
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.wire.disconnect import unless_client_leaves
from treeserve.runtime.roles import (is_generator, no_generator_served, no_verifier_served, not_a_generator,
                                     not_a_verifier)
from treeserve.server.metrics import ServerMetrics
from treeserve.server.serving import OpenAIServing, unknown_model
from treeserve.server.serving_rewards import RewardServing
from treeserve.server.serving_search import SearchServing
from treeserve.wire.bodies import parse, parse_chosen
from treeserve.wire.chat_completions import ChatCompletionRequest
from treeserve.wire.chat_messages import template_ending
from treeserve.wire.completions import CompletionRequest
from treeserve.wire.drain import Drain, readiness
from treeserve.wire.errors import APIError, error_response, from_value_error
from treeserve.wire.rewards import PoolingRequest, RewardRequest
from treeserve.wire.score import ScoreBody, VLLMScoreRequest, score_body_model
from treeserve.wire.search import SearchRequest
from treeserve.wire.tokenization import DetokenizeRequest, TokenizeRequest

# the request bodies of the routes below, for /openapi.json
REQUEST_MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                  "/v1/rewards": RewardRequest, "/pooling": PoolingRequest, "/v1/score": ScoreBody,
                  "/score": ScoreBody,
                  "/v1/search": SearchRequest, "/tokenize": TokenizeRequest,
                  "/detokenize": DetokenizeRequest}

BodyT = TypeVar("BodyT", bound=BaseModel)


class ServedModels:
    """The served models' OpenAI serving and search serving, by name; the first is the default."""

    def __init__(self, servings: dict[str, OpenAIServing], searches: dict[str, SearchServing],
                 scoring: RewardServing | None = None):
        self.servings, self.searches = servings, searches
        self.created = int(time.time())
        first = next(iter(searches.values()), None)
        if scoring is None and first is not None:
            scoring = RewardServing(first.engine, first.scorers)
        self.scoring = scoring

    def serving(self, model: str | None) -> OpenAIServing:
        if model is None:
            return next(iter(self.servings.values()))
        if model not in self.servings:
            raise unknown_model(model, list(self.servings))
        return self.servings[model]

    def generator(self, model: str | None) -> OpenAIServing:
        """The serving of a model that generates (chat, completions, a search's `model`): a reward
        model (a reward head) is a 400 saying so."""
        serving = self.serving(model)
        config = serving.llm.model_config
        if not is_generator(config):
            raise APIError(400, f"model: {not_a_generator(serving.model_name, config.architecture)}", param="model",
                           code="model_not_a_generator")
        return serving

    def only_generator(self) -> str:
        """The model a chat, completion or response that names none means (vLLM's: its served model): the
        one served generator (a model served as a verifier generates only when nothing else does)."""
        generators = [name for name, serving in self.servings.items() if is_generator(serving.llm.model_config)]
        verifiers = set(self.scoring.scorers) if self.scoring is not None else set()
        names = [name for name in generators if name not in verifiers] or generators
        if not names:  # (the answer naming one of them gets: vLLM's is the same, named or not)
            architectures = {name: s.llm.model_config.architecture for name, s in self.servings.items()}
            raise APIError(400, f"model: {no_generator_served(architectures)}", param="model",
                           code="model_not_a_generator")
        return _the_one(names, "generator", "generators")

    def meant_generator(self, model: str | None) -> OpenAIServing:
        """The serving of the generator `model` names, or that a body naming none means (`only_generator`)."""
        return self.generator(model if model is not None else self.only_generator())

    def meant_serving(self, model: str | None) -> OpenAIServing:
        """/tokenize's and /detokenize's model: the one named, else the one a chat naming none would be
        served by (its tokenizer and chat template count that chat), else, where none generates, the first."""
        if model is None and not any(is_generator(s.llm.model_config) for s in self.servings.values()):
            return self.serving(None)
        return self.serving(model if model is not None else self.only_generator())

    def with_generator(self, body: BodyT) -> BodyT:
        """A chat or completion body naming its model: one that names none (vLLM's may leave `model`
        out, its served model meant) is the one served generator's."""
        return body if body.model is not None else body.model_copy(update={"model": self.only_generator()})

    def search(self, model: str | None) -> SearchServing:
        if not self.searches:
            raise APIError(400, "search: this server was started without search serving", code="unsupported")
        return self.searches[model] if model is not None else next(iter(self.searches.values()))

    def verifiers(self) -> list[str]:
        """The models served as reward models."""
        return list(self.scoring.scorers) if self.scoring is not None else []

    def verifier(self, model: str, param: str) -> None:
        """`model` is served (else a 404) as a reward model (else a 400 saying so, naming those that are)."""
        self.serving(model)
        if model not in self.verifiers():
            raise APIError(400, f"{param}: {not_a_verifier(model, self.verifiers())}", param=param,
                           code="model_not_a_verifier")

    def only_verifier(self) -> str:
        """The served reward model, where there is one: the model of a request that names none."""
        names = self.verifiers()
        if not names:  # (the answer naming one of them gets)
            raise APIError(400, f"model: {no_verifier_served(list(self.servings))}", param="model",
                           code="model_not_a_verifier")
        return _the_one(names, "reward model", "reward models")

    def with_verifier(self, body: BodyT) -> BodyT:
        """A scoring body naming its reward model: one that names none (vLLM's pooling and score bodies
        may leave `model` out, a server of one model meaning it) scores with the one served."""
        return body if body.model is not None else body.model_copy(update={"model": self.only_verifier()})

    def rewards(self, model: str) -> RewardServing:
        if self.scoring is None:
            raise APIError(400, "model: this server was started without reward models", param="model",
                           code="unsupported")
        self.serving(model)  # (an unknown model: 404)
        self.scoring.scorer(model, "model")  # (one served, but not as a verifier: 400)
        return self.scoring

    def card(self, name: str) -> dict:
        """vLLM's model card: `root` is what the model was loaded from (a path or builtin:NAME)."""
        serving = self.servings[name]
        return {"id": name, "object": "model", "created": self.created, "owned_by": "treeserve",
                "root": str(serving.llm.config.model), "parent": None, "max_model_len": serving.max_model_len,
                "permission": [model_permission(self.created)]}



def _the_one(names: list[str], kind: str, kinds: str) -> str:
    """The model a body that names none means, where one of its kind is served (else a 400 naming
    `model` and listing them)."""
    if len(names) != 1:
        raise APIError(400, f"model: this field is required: it names the {kind}, and {len(names)} {kinds} are "
                       f"served ({', '.join(names)})", param="model", code="missing_required_parameter")
    return names[0]

def model_permission(created: int) -> dict:
    """vLLM's ModelPermission (OpenAI's former schema): sampling, logprobs and viewing allowed."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def operator_routes(engine: AsyncLLMEngine, drain: Drain, metrics: ServerMetrics | None) -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_class=Response,
                responses={200: {"description": "the engine is alive (empty body)"},
                           503: {"description": "the engine failed"}})
    async def health():
        if engine.errored is not None:
            return error_response(503, f"engine failed: {engine.errored}")
        return Response(status_code=200)

    for method in (router.get, router.post):  # vLLM's /ping (SageMaker's health check): /health's answer
        method("/ping", response_class=Response, responses={200: {"description": "the engine is alive (empty body)"},
                                                            503: {"description": "the engine failed"}})(health)

    @router.get("/health/ready", response_class=Response,
                responses={200: {"description": "ready for requests (empty body)"},
                           503: {"description": "draining for shutdown, or the engine failed"}})
    async def ready():
        return readiness(drain, None if engine.errored is None else str(engine.errored))

    @router.get("/version")
    async def version():
        return {"version": __version__}

    @router.get("/metrics", response_class=Response,
                responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus():
        body = metrics.render() if metrics else b""  # here on the event loop: ~0.1-0.2 ms, no engine-thread work
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router


def openai_routes(served: ServedModels, max_body_bytes: int) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card(name) for name in served.servings]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return served.card(served.serving(model_id).model_name)

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        body = served.with_generator(await parse(request, ChatCompletionRequest, max_body_bytes))
        return await unless_client_leaves(request, served.generator(body.model).chat(body))

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = served.with_generator(await parse(request, CompletionRequest, max_body_bytes))
        return await unless_client_leaves(request, served.generator(body.model).completions(body))

    @router.post("/v1/rewards")
    async def rewards(request: Request):
        body = served.with_verifier(await parse(request, RewardRequest, max_body_bytes))
        return await unless_client_leaves(request, served.rewards(body.model).rewards(body))

    @router.post("/pooling")
    async def pooling(request: Request):
        body = served.with_verifier(await parse(request, PoolingRequest, max_body_bytes))
        return await unless_client_leaves(request, served.rewards(body.model).pooling(body))

    @router.post("/v1/score")
    @router.post("/score")  # (vLLM's path for its score API; /v1/score is its older one)
    async def score(request: Request):
        body = served.with_verifier(await parse_chosen(request, score_body_model, max_body_bytes))
        scoring = served.rewards(body.model)
        if isinstance(body, VLLMScoreRequest):
            return await unless_client_leaves(request, scoring.score_pairs(body))
        return await unless_client_leaves(request, scoring.score_candidates(body))

    @router.post("/v1/search")
    async def search(request: Request):
        body = await parse(request, SearchRequest, max_body_bytes)
        serving = served.meant_generator(body.model)
        if body.verifier is not None:
            served.verifier(body.verifier, "verifier")
        return await served.search(serving.model_name).search(body, request)

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest, max_body_bytes)
        serving = served.meant_serving(body.model)
        tokens = _tokenized(serving, body)
        strs = serving.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len, "token_strs": strs}

    @router.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest, max_body_bytes)
        serving = served.meant_serving(body.model)
        vocab = serving.llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:3]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    return router


def _tokenized(serving: OpenAIServing, body: TokenizeRequest) -> list[int]:
    """/tokenize's tokens: the messages as the chat template renders them, or the prompt."""
    if body.messages is not None:
        try:
            ending = template_ending(body.messages, body.add_generation_prompt, body.continue_final_message)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return serving.render(body.messages, body.tools, ending, body.chat_template_kwargs, body.special_tokens_added(),
                              request_template=body.chat_template)
    if body.prompt is not None:
        return serving.tokenizer.encode(body.prompt, add_special_tokens=body.special_tokens_added())
    raise APIError(400, "prompt: give 'prompt' or 'messages'", param="prompt", code="missing_required_parameter")


def not_found_route() -> APIRouter:
    """Any other path: 404 in the error shape of the API the path belongs to (Anthropic's under
    /v1/messages, as the gateway's; else OpenAI's), after every real route."""
    router = APIRouter()

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def unknown(path: str):
        raise APIError(404, f"route /{path} not found", code="not_found")

    return router
