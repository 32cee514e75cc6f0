"""The gateway's FastAPI app: OpenAI routes forwarded to backends, the admin API, health and metrics.

One request's road: its key is checked (401 unknown, 403 model not allowed), then admitted in one
database transaction (parallel slot, the minute's request count, the worst-case cost reserved on
its key and user: 429 or 400 when refused), forwarded (`proxy.Forwarder`), and settled to its real
cost from the backend's `usage` once it has ended."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from treeserve.gateway import pricing
from treeserve.gateway.admin import admin_router
from treeserve.gateway.broker import BrokerClient
from treeserve.gateway.chat.routes import ChatApp
from treeserve.gateway.config import BROKER_SCHEMES, GatewayConfig
from treeserve.gateway.health import health_loop
from treeserve.gateway.key_cache import KeyCache
from treeserve.gateway.keys import KeyRecord, same_secret
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.proxy import Forwarder, Outcome, new_request_id
from treeserve.gateway.routing import Router, affinity_key
from treeserve.gateway.settlement import Reservation, Settlement
from treeserve.gateway.database import default_url
from treeserve.wire.drain import Drain, DrainMiddleware, readiness
from treeserve.gateway.store import Store, utcnow
from treeserve.wire import openapi
from treeserve.wire.errors import APIError, error_response, from_value_error, install_error_handlers
from treeserve.wire.protocol import ChatCompletionRequest, CompletionRequest, RewardRequest, SearchRequest

log = logging.getLogger("treeserve.gateway")
MAX_BODY_BYTES = 32 << 20
MASTER = KeyRecord(None, "master", "master", None, None, None, None, None, None)  # type: ignore[arg-type]
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/search": "search",
          "/v1/rewards": "rewards"}


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Accounting:
    """Settles one admitted request, once: spend, tokens, a log row, metrics."""

    def __init__(self, app: FastAPI, key: KeyRecord, reservation: Reservation, model: str, route: str, stream: bool):
        self.app, self.key, self.reservation = app, key, reservation
        self.model, self.route, self.stream = model, route, stream
        self.request_id, self.started_at, self.done = new_request_id(), utcnow(), False

    async def __call__(self, outcome: Outcome) -> None:
        if self.done:
            return
        self.done = True
        config: GatewayConfig = self.app.state.config
        model = outcome.model or self.model
        usage = outcome.usage
        cost = pricing.cost(config.models[model], usage.prompt_tokens, usage.completion_tokens)
        try:  # at once: the client's next request must find its slot free and its budget held only for `cost`
            if self.reservation.parallel or self.reservation.held:
                await run_in_threadpool(self.app.state.store.release, self.reservation, cost)
        except Exception:  # the slot and the worst case go back with the settlement's batch instead
            log.exception("releasing a request's hold at its answer failed; its settlement gives it back")
        finally:
            self.app.state.store.settle_later(Settlement(
                self.reservation, self.request_id, model, outcome.backend, self.route, self.stream, outcome.status,
                usage, cost, self.started_at))
        log.info("%s %s key=%s model=%s backend=%s %s tokens=%d+%d cost=%.6g", self.request_id, self.route,
                 self.key.label, model, outcome.backend, outcome.status, usage.prompt_tokens,
                 usage.completion_tokens, cost)
        metrics: GatewayMetrics = self.app.state.metrics
        metrics.key_requests.labels(self.key.label, outcome.status).inc()
        metrics.key_tokens.labels(self.key.label, model, "prompt").inc(usage.prompt_tokens)
        metrics.key_tokens.labels(self.key.label, model, "completion").inc(usage.completion_tokens)
        metrics.key_spend.labels(self.key.label).inc(cost)


def _warn_unpriced_budgets(keys: int, users: int) -> None:
    if keys or users:
        log.warning(pricing.unpriced_budgets(keys, users))


def build_app(config: GatewayConfig, store: Store | None = None) -> FastAPI:
    store = store or Store(config.database or default_url())
    metrics = GatewayMetrics()
    router = Router(config)
    keys = KeyCache(config.key_cache_ttl)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(store.migrate)
        if not config.priced:
            _warn_unpriced_budgets(*await run_in_threadpool(store.budgeted_accounts))
        store.start()  # heartbeats, and the sweep of dead processes' holdings, from now on
        # aiohttp for the upstream side: its C parser reads a stream at a fraction of httpx's cost per chunk
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)  # under uvicorn's 5 s keep-alive
        client = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                       json_serialize=json.dumps)
        brokers = {b.url: BrokerClient(b.url) for b in router.backends() if b.url.startswith(BROKER_SCHEMES)}
        for broker in brokers.values():
            await broker.start()
        app.state.forwarder = Forwarder(router, client, metrics, config.retries, brokers)
        drain.on_time_up.append(app.state.forwarder.cut_streams)  # streams end with an error event, billed
        health = asyncio.create_task(health_loop(router, client, metrics, config.health_interval, brokers)) \
            if config.health_interval > 0 else None
        try:
            yield
        finally:
            if health is not None:
                health.cancel()
            try:
                await client.close()
                if app.state.chat is not None:
                    await app.state.chat.close()
                for broker in brokers.values():
                    await broker.close()
            finally:
                store.close()

    app = FastAPI(title="treeserve gateway", lifespan=lifespan)
    app.state.config, app.state.store, app.state.metrics, app.state.router = config, store, metrics, router
    app.state.drain = drain = Drain(config.shutdown_timeout)
    app.add_middleware(DrainMiddleware, drain=drain)  # while stopping: new requests 503, running ones finish
    install_error_handlers(app)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError):  # a ParamError names its parameter
        err = from_value_error(exc)
        return error_response(err.status, err.message, err.param, err.code)

    async def require_master(request: Request) -> None:
        log.info("admin %s %s", request.method, request.url.path)  # (never the query: keys go there)
        token = _bearer(request)
        if not config.master_key:
            raise APIError(403, "the admin API is off: start the gateway with --master-key (or TREESERVE_MASTER_KEY)",
                           code="no_master_key")
        if token is None or not same_secret(token, config.master_key):
            raise APIError(401, "the admin API needs the master key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def require_key(request: Request) -> KeyRecord:
        token = _bearer(request)
        if token is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        if config.master_key and same_secret(token, config.master_key):
            return MASTER
        key = keys.get(token)
        if key is None or key.expired:
            key = await keys.load(token, lambda: run_in_threadpool(store.authenticate, token))
            if key is None:
                raise APIError(401, "invalid API key (unknown, expired or blocked)", code="invalid_api_key")
        return key

    app.include_router(admin_router(store, require_master, set(config.models), on_change=keys.clear,
                                    priced=config.priced))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health/ready", responses={503: {"description": "draining for shutdown"}})
    async def ready():
        return readiness(drain)

    @app.get("/health/backends", dependencies=[Depends(require_master)])
    async def backends():
        return [{"model": b.model, "url": b.name, "healthy": b.healthy, "circuit": b.breaker.state,
                 "outstanding_requests": b.outstanding, "last_error": b.last_error}
                | ({"queue_depth": b.queue_depth, "consumers": b.consumers} if b.consumers is not None else {})
                for b in router.backends()]

    @app.get("/metrics", dependencies=[Depends(require_master)])
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models(key: KeyRecord = Depends(require_key)):
        return {"object": "list", "data": [_model_card(name) for name in config.models if key.allows(name)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, key: KeyRecord = Depends(require_key)):
        if model not in config.models or not key.allows(model):
            raise APIError(404, f"model: the model {model!r} does not exist", param="model", code="model_not_found")
        return _model_card(model)

    async def proxy(request: Request, key: KeyRecord = Depends(require_key)):
        return await dispatch(request.url.path, await _json_body(request), key)

    async def dispatch(path: str, body: dict, key: KeyRecord) -> Response:
        """One OpenAI request on `key`'s account: checked, admitted, forwarded, settled. Refusals
        raise APIError; a backend's own error comes back as its response."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model: this field is required", param="model", code="missing_required_parameter")
        if model not in config.models:
            raise APIError(404, f"model: the model {model!r} does not exist", param="model", code="model_not_found")
        for field in ("model", "verifier"):  # a search names its verifier model too
            if isinstance(body.get(field), str) and not key.allows(body[field]):
                raise APIError(403, f"{field}: this key may not use {body[field]!r}", param=field,
                               code="model_not_allowed")
        started = time.perf_counter()
        stream = bool(body.get("stream"))
        if key.holds_nothing:  # (the master key too) nothing to reserve or count: no trip to a worker thread
            reservation = key.nothing_held()
        else:
            worst = max(pricing.worst_cost(body, config.models[name], search=path == "/v1/search")
                        for name in router.chain(model))
            try:
                reservation = await run_in_threadpool(store.admit, key, worst)
            except APIError as exc:
                metrics.key_requests.labels(key.label, exc.code or "refused").inc()
                raise
        settle = Accounting(app, key, reservation, model, ROUTES[path], stream)
        return await app.state.forwarder.forward(path, body, model, affinity_key(body), settle, started,
                                                 settle.request_id)

    for path in ROUTES:
        app.add_api_route(path, proxy, methods=["POST"])
    # /openapi.json describes the OpenAI routes' bodies as a treeserve server takes them (the gateway
    # itself reads only `model`, `verifier`, `stream` and the token bounds, and passes the rest on)
    openapi.install(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/search": SearchRequest, "/v1/rewards": RewardRequest})
    app.state.dispatch = dispatch
    app.state.chat = ChatApp(config, store, dispatch, metrics) if config.chat.enabled else None
    if app.state.chat is not None:
        app.include_router(app.state.chat.router)
    return app


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {len(raw)} bytes; the gateway takes at most {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "treeserve-gateway"}

