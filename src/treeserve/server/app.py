"""The server's FastAPI app, wired: auth on every route but the health probes (server/http_io.py),
answers kept for repeated Idempotency-Keys (server/idempotency.py), graceful drain (wire/drain.py), the operator and OpenAI routes
(server/routes.py), metrics (server/metrics.py)."""
from __future__ import annotations

import logging

from fastapi import FastAPI

from treeserve import __version__
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.llm_engine import LLMEngine
from treeserve.server.http_io import MAX_BODY_BYTES, APIKeyMiddleware
from treeserve.server.idempotency import IdempotencyMiddleware, IdempotentReplies
from treeserve.server.metrics import ServerMetrics
from treeserve.server.routes import REQUEST_MODELS, ServedModels, not_found_route, openai_routes, operator_routes
from treeserve.server.serving import OpenAIServing
from treeserve.server.serving_rewards import RewardServing
from treeserve.server.serving_search import SearchServing
from treeserve.server.tool_calls import ToolSettings
from treeserve.server.translated_routes import REQUEST_MODELS as TRANSLATED_MODELS, messages_routes, responses_routes
from treeserve.wire import openapi
from treeserve.wire.drain import Drain, DrainMiddleware
from treeserve.wire.errors import APIError, install_error_handlers
from treeserve.wire.request_ids import AnthropicRequestIdMiddleware, XRequestIdMiddleware

log = logging.getLogger("treeserve.server")


def create_app(engine: AsyncLLMEngine, served: dict[str, LLMEngine], api_keys: list[str] | None = None,
               metrics: ServerMetrics | None = None, searches: dict[str, SearchServing] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, chat_template: str | None = None,
               tool_settings: ToolSettings | None = None, drain: Drain | None = None,
               scorers: dict | None = None, request_id_headers: bool = False,
               trust_request_chat_template: bool = False) -> FastAPI:
    """`served` maps each served model name to its engine; requests are routed by their `model`.
    `searches` holds the search serving of each served generator (see server/launch.py); `scorers`
    the served verifiers' StepScorers (default: the searches' ones).
    `chat_template` replaces every served model's; `tool_settings` are the tool-call parser's;
    `trust_request_chat_template`: a request's own `chat_template` is rendered (vLLM's flag; else a 400).
    `drain` is the server's shutdown state (wire/drain.py): /health/ready and the 503s it gives.
    `request_id_headers`: every answer carries `X-Request-Id` (vLLM's --enable-request-id-headers)."""
    servings = {name: OpenAIServing(engine, name, llm, chat_template, tool_settings, trust_request_chat_template)
                for name, llm in served.items()}
    searches, drain, keys = searches or {}, drain or Drain(), [k for k in (api_keys or []) if k]
    app = FastAPI(title="treeserve", version=__version__, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.engine, app.state.metrics, app.state.drain = engine, metrics, drain
    app.state.search_runners = {name: serving.runner for name, serving in searches.items()}
    app.state.served_models = list(servings)
    install_error_handlers(app)
    app.state.idempotent_replies = IdempotentReplies()
    app.add_middleware(IdempotencyMiddleware, replies=app.state.idempotent_replies)  # inside the key check
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys)
    app.add_middleware(DrainMiddleware, drain=drain)  # outside the key check, so it counts every request
    if request_id_headers:  # (a refusal's answer has it too; /v1/messages' `request-id` is the same id)
        app.add_middleware(XRequestIdMiddleware)
    app.add_middleware(AnthropicRequestIdMiddleware)  # (outermost: every answer on /v1/messages has its id)
    drain.on_time_up.append(lambda: _cut_streams(engine))
    app.include_router(operator_routes(engine, drain, metrics))
    served_models = ServedModels(servings, searches, RewardServing(engine, scorers) if scorers is not None else None)
    app.include_router(openai_routes(served_models, max_body_bytes))
    app.include_router(responses_routes(served_models, max_body_bytes))
    app.include_router(messages_routes(served_models, max_body_bytes))
    openapi.install(app, REQUEST_MODELS | TRANSLATED_MODELS)
    app.include_router(not_found_route())
    return app


def _cut_streams(engine: AsyncLLMEngine) -> None:
    """The drain's time is up: every reply still running (streamed or whole, a search's too) ends
    with a `shutting_down` error its client can read, instead of a connection cut mid-chunk."""
    cut = engine.cut_streams(lambda: APIError(503, "the server is shutting down: its --shutdown-timeout ran out "
                                                   "before this request ended", code="shutting_down"))
    if cut:
        log.warning("the drain's time is up: ending the replies still running (%d engine stream(s)) with a "
                    "shutting_down error", cut)
