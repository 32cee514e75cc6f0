"""The gateway's FastAPI app, wired: the OpenAI routes over the request path (gateway/service.py),
the Responses and Messages APIs (gateway/translated_routes.py), Files and Batches (gateway/batch_routes.py,
run by gateway/batch_runner.py),
the admin API (gateway/admin.py), health and metrics (gateway/routes.py), the web chat; the services
over the database (gateway/store.py); domain errors answered as HTTP (gateway/http_errors.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from treeserve.gateway import pricing
from treeserve.gateway.accounting import Accounting
from treeserve.gateway.admin import admin_router, key_info_router
from treeserve.gateway.team_routes import team_router
from treeserve.gateway.auth import Auth
from treeserve.gateway.batch_routes import batch_routes
from treeserve.gateway.batch_runner import BatchRunner
from treeserve.gateway.chat.routes import ChatApp
from treeserve.gateway.chat.store import ChatStore
from treeserve.gateway.config import GatewayConfig
from treeserve.gateway.database import configured_url
from treeserve.gateway.files import MAX_FILE_BYTES
from treeserve.gateway.health import health_loop
from treeserve.gateway.heartbeat import keep_ticking
from treeserve.gateway.http_errors import install_domain_error_handlers
from treeserve.gateway.key_cache import KeyCache
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.proxy import Forwarder
from treeserve.gateway.conversation_store import DatabaseConversationStore
from treeserve.gateway.response_store import DatabaseResponseStore
from treeserve.gateway.routes import MAX_BODY_BYTES, openai_routes, operator_routes
from treeserve.gateway.routing import Router
from treeserve.gateway.service import GatewayService
from treeserve.gateway.store import Store
from treeserve.gateway.translated_routes import REQUEST_MODELS as TRANSLATED_MODELS, translated_routes
from treeserve.gateway.unversioned import UnversionedPathMiddleware
from treeserve.gateway.upstreams import Upstreams
from treeserve.wire import openapi
from treeserve.wire.bodies import BodyLimitMiddleware
from treeserve.wire.chat_completions import ChatCompletionRequest
from treeserve.wire.completions import CompletionRequest
from treeserve.wire.drain import Drain, DrainMiddleware
from treeserve.wire.errors import install_error_handlers
from treeserve.wire.request_ids import AnthropicRequestIdMiddleware
from treeserve.wire.rewards import RewardRequest
from treeserve.wire.search import SearchRequest

log = logging.getLogger("treeserve.gateway")
UPLOAD_FRAMING_BYTES = 1 << 20  # an upload's multipart boundaries, headers and `purpose` field


def build_app(config: GatewayConfig, store: Store | None = None) -> FastAPI:
    store = store or Store(configured_url(config.database))
    metrics, router = GatewayMetrics(), Router(config)
    upstreams = Upstreams(router)
    drain = Drain(config.shutdown_timeout)
    # (a request cancelled once the drain's time is up is the gateway's doing, not its client's)
    forwarder = Forwarder(router, upstreams, metrics, config.retries,
                          stopping=lambda: drain.cut_at is not None or drain.forced)
    metrics.watch(store.heartbeat, store.ledger.writer_busy_for)
    accounting = Accounting(config.models, store.admission, store.ledger, metrics)
    service = GatewayService(config, router, metrics, store.admission, accounting, forwarder)
    keys = KeyCache(config.key_cache_ttl)
    auth = Auth(config.master_key, store.accounts, keys)
    chat = ChatApp(config, service, ChatStore(store.db, store.accounts), metrics) if config.chat.enabled else None
    drain.on_time_up.append(forwarder.cut_streams)  # streams end with an error event, billed

    responses = DatabaseResponseStore(store.db)
    runner = BatchRunner(store.batches, store.accounts, store.ledger, service, responses,
                         store.instances.instance_id, config.batch_concurrency, config.batch_priority)
    app = FastAPI(title="treeserve gateway",
                  lifespan=_lifespan(config, store, upstreams, router, metrics, chat, runner))
    app.state.config, app.state.store, app.state.metrics, app.state.router = config, store, metrics, router
    app.state.drain, app.state.service, app.state.chat = drain, service, chat
    app.add_middleware(DrainMiddleware, drain=drain)  # while stopping: new requests 503, running ones finish
    app.add_middleware(BodyLimitMiddleware, limit=body_limit)  # before any route (or key check) reads a body
    app.add_middleware(AnthropicRequestIdMiddleware)  # (every answer on /v1/messages has its id)
    app.add_middleware(UnversionedPathMiddleware)  # (outermost: LiteLLM's /chat/completions is /v1/chat/completions)
    install_error_handlers(app)
    install_domain_error_handlers(app)
    app.include_router(admin_router(store.accounts, store.ledger, auth.require_master, set(config.models),
                                    on_change=keys.clear, priced=config.priced, master_key=config.master_key))
    app.include_router(key_info_router(store.accounts, store.ledger, auth.require_key))
    app.include_router(team_router(store.teams, store.ledger, auth.require_master, set(config.models),
                                   on_change=keys.clear, priced=config.priced))
    app.include_router(operator_routes(router, metrics, drain, auth, store.db))
    app.include_router(openai_routes(config, service, auth))
    app.include_router(translated_routes(service, auth, responses, DatabaseConversationStore(store.db),
                                         MAX_BODY_BYTES))
    app.include_router(batch_routes(store.files, store.batches, auth))
    # /openapi.json describes the OpenAI routes' bodies as a treeserve server takes them (the gateway
    # itself reads only `model`, `verifier`, `stream` and the token bounds, and passes the rest on),
    # but for `model`, which a server may default and the gateway routes by: required here
    openapi.install(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/search": SearchRequest, "/v1/rewards": RewardRequest} | TRANSLATED_MODELS,
                    required=("model",))
    if chat is not None:
        app.include_router(chat.router)
    return app


def body_limit(path: str) -> int:
    """The most bytes a request body may have: a file upload's (MAX_FILE_BYTES and its multipart
    framing), else MAX_BODY_BYTES."""
    return MAX_FILE_BYTES + UPLOAD_FRAMING_BYTES if path == "/v1/files" else MAX_BODY_BYTES


def _lifespan(config: GatewayConfig, store: Store, upstreams: Upstreams, router: Router, metrics: GatewayMetrics,
              chat: ChatApp | None, batch_runner: BatchRunner):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await run_in_threadpool(store.migrate)
        if not config.priced:
            _warn_unpriced_budgets(*await run_in_threadpool(store.accounts.budgeted_accounts))
        store.start()  # heartbeats, and the sweep of dead processes' holdings, from now on
        ticking = asyncio.create_task(keep_ticking(store.heartbeat))  # (no beats while this loop is stuck)
        try:
            await upstreams.open()
            health = asyncio.create_task(health_loop(router, upstreams.client, metrics, config.health_interval,
                                                     upstreams.brokers)) if config.health_interval > 0 else None
            batches = asyncio.create_task(batch_runner.run())
            try:
                yield
            finally:
                if health is not None:
                    health.cancel()
                batches.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await batches
        finally:
            try:
                await upstreams.close()
                if chat is not None:
                    await chat.close()
            finally:
                ticking.cancel()
                store.heartbeat.unwatch()  # (store.close blocks this loop while it commits what is queued)
                store.close()
    return lifespan


def _warn_unpriced_budgets(keys: int, users: int) -> None:
    if keys or users:
        log.warning(pricing.unpriced_budgets(keys, users))
