"""The FastAPI app: auth on every route but the health probes, body limits, graceful drain, OpenAI
routes, metrics."""
from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from treeserve import __version__
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.llm_engine import LLMEngine
from treeserve.wire.drain import Drain, DrainMiddleware, readiness
from treeserve.wire.errors import APIError, error_response, from_validation_error, install_error_handlers
from treeserve.wire import openapi
from treeserve.server.metrics import ServerMetrics
from treeserve.wire.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       RewardRequest, SearchRequest, TokenizeRequest)
from treeserve.server.serving import OpenAIServing, unknown_model
from treeserve.server.serving_search import SearchServing
from treeserve.server.tool_calls import ToolSettings

MAX_BODY_BYTES = 2 << 20
OPEN_PATHS = {"/health", "/health/ready"}  # the probes a load balancer sends


def keys_match(presented: str, keys: list[str]) -> bool:
    """Constant-time comparison against every configured key."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched


class APIKeyMiddleware:
    """Every route but the probes (/health, /health/ready) needs `Authorization: Bearer KEY`. A plain ASGI middleware: it leaves
    the request's receive channel alone, so handlers see a client's disconnect."""

    def __init__(self, app, keys: list[str]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorised(scope):
            response = error_response(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                      code="invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and keys_match(token.strip(), self.keys)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for piece in request.stream():
        body.extend(piece)
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    return bytes(body)


async def parse(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def create_app(engine: AsyncLLMEngine, served: dict[str, LLMEngine], api_keys: list[str] | None = None,
               metrics: ServerMetrics | None = None, searches: dict[str, SearchServing] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, chat_template: str | None = None,
               tool_settings: ToolSettings | None = None, drain: Drain | None = None) -> FastAPI:
    """`served` maps each served model name to its engine; requests are routed by their `model`.
    `searches` holds the search serving of each served generator (see server/launch.py).
    `chat_template` replaces every served model's; `tool_settings` are the tool-call parser's.
    `drain` is the server's shutdown state (wire/drain.py): /health/ready and the 503s it gives."""
    app = FastAPI(title="treeserve", version=__version__, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    servings = {name: OpenAIServing(engine, name, llm, chat_template, tool_settings) for name, llm in served.items()}
    default = next(iter(servings.values()))
    searches = searches or {}
    keys = [k for k in (api_keys or []) if k]

    def serving_for(model: str | None) -> OpenAIServing:
        if model is None:
            return default
        if model not in servings:
            raise unknown_model(model, list(servings))
        return servings[model]
    def search_for(model: str | None) -> SearchServing:
        if not searches:
            raise APIError(400, "search: this server was started without search serving", code="unsupported")
        return searches[model] if model is not None else next(iter(searches.values()))
    created = int(time.time())
    app.state.engine, app.state.metrics = engine, metrics
    app.state.search_runners = {name: serving.runner for name, serving in searches.items()}
    app.state.served_models = list(servings)
    app.state.drain = drain = drain or Drain()
    install_error_handlers(app)

    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys)
    app.add_middleware(DrainMiddleware, drain=drain)  # added last: the outermost, so it counts every request

    @app.get("/health", response_class=Response, responses={200: {"description": "the engine is alive (empty body)"},
                                                               503: {"description": "the engine failed"}})
    async def health():
        if engine.errored is not None:
            return error_response(503, f"engine failed: {engine.errored}")
        return Response(status_code=200)

    @app.get("/health/ready", response_class=Response,
             responses={200: {"description": "ready for requests (empty body)"},
                        503: {"description": "draining for shutdown, or the engine failed"}})
    async def ready():
        return readiness(drain, None if engine.errored is None else str(engine.errored))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus():
        body = metrics.render() if metrics else b""  # here on the event loop: ~0.1-0.2 ms, no engine-thread work
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "treeserve",
                "max_model_len": servings[name].max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in servings]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return card(serving_for(model_id).model_name)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse(request, ChatCompletionRequest, max_body_bytes)
        return await serving_for(body.model).chat(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest, max_body_bytes)
        return await serving_for(body.model).completions(body)

    @app.post("/v1/rewards")
    async def rewards(request: Request):
        body = await parse(request, RewardRequest, max_body_bytes)
        serving_for(body.model)
        return await search_for(None).rewards(body)

    @app.post("/v1/search")
    async def search(request: Request):
        body = await parse(request, SearchRequest, max_body_bytes)
        serving = serving_for(body.model)
        if body.verifier is not None:
            serving_for(body.verifier)
        return await search_for(serving.model_name).search(body, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest, max_body_bytes)
        serving = serving_for(body.model)
        if body.messages is not None:
            tokens = serving.render(body.messages, body.tools, body.add_generation_prompt)
        elif body.prompt is not None:
            tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "prompt: give 'prompt' or 'messages'", param="prompt", code="missing_required_parameter")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest, max_body_bytes)
        serving = serving_for(body.model)
        vocab = serving.llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:3]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    openapi.install(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/rewards": RewardRequest, "/v1/search": SearchRequest, "/tokenize": TokenizeRequest,
                          "/detokenize": DetokenizeRequest})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def unknown(path: str):
        return JSONResponse({"error": {"message": f"route /{path} not found", "type": "not_found_error",
                                       "param": None, "code": "not_found"}}, status_code=404)

    return app
