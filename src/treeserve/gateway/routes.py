"""The gateway's own routes: the OpenAI ones (the model list, and the requests handed to
`GatewayService.dispatch`), and the operator's (health probes, backends, Prometheus metrics)."""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from treeserve.gateway.auth import Auth, client_key
from treeserve.gateway.config import GatewayConfig
from treeserve.gateway.database import Database
from treeserve.gateway.fields import NO_NUL
from treeserve.gateway.health import model_health
from treeserve.gateway.keys import KeyRecord
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.model_info import model_info
from treeserve.gateway.routing import Router
from treeserve.gateway.service import ROUTES, GatewayService
from treeserve.wire.bodies import read_body
from treeserve.wire.disconnect import unless_client_leaves
from treeserve.wire.drain import Drain, readiness
from treeserve.wire.errors import APIError, error_response

log = logging.getLogger("treeserve.gateway")
MAX_BODY_BYTES = 32 << 20
LIVELINESS = "I'm alive!"  # LiteLLM's liveness answer (a JSON string)
PING_TIMEOUT = 2.0  # seconds readiness waits for the database's SELECT 1


def openai_routes(config: GatewayConfig, service: GatewayService, auth: Auth) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def list_models(key: KeyRecord = Depends(auth.require_key)):
        return {"object": "list", "data": [_model_card(name) for name in config.models if key.allows(name)]}

    @routes.get("/model/info")
    @routes.get("/v1/model/info")  # (LiteLLM answers both)
    async def deployments(key: KeyRecord = Depends(auth.require_key)):
        """LiteLLM's: each deployment (a backend) of each model the key may use, with its
        `litellm_params` (no secret: gateway/model_info.py) and its model's prices, token cap, fallbacks
        and backends."""
        return model_info(config, key)

    @routes.get("/v1/models/{model:path}")
    async def get_model(model: str, key: KeyRecord = Depends(auth.require_key)):
        if model not in config.models or not key.allows(model):
            raise APIError(404, f"model: the model {model!r} does not exist", param="model", code="model_not_found")
        return _model_card(model)

    async def proxy(request: Request, key: KeyRecord = Depends(auth.require_key)):
        body = await _json_body(request)
        return await unless_client_leaves(request, service.dispatch(request.url.path, body, key), idempotent=False)

    for path in ROUTES:
        routes.add_api_route(path, proxy, methods=["POST"])
    return routes


def operator_routes(router: Router, metrics: GatewayMetrics, drain: Drain, auth: Auth, db: Database) -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health(request: Request, model: str | None = Query(None, max_length=256, pattern=NO_NUL)):
        """Liveness for a probe that sends no key (`{"status": "ok"}`: load balancers, `until curl`);
        with a key, LiteLLM's `/health`: the health of the backends of the models that key may use,
        of `model` alone when it names one (a key that is not valid is a 401, as on every route that
        reads one)."""
        if client_key(request) is None:
            return {"status": "ok"}
        key = await auth.require_key(request)
        return model_health(router, key.allows, model)

    ping = DatabasePing(db)

    @routes.get("/health/ready", responses={503: {"description": "draining for shutdown"}})
    async def ready():
        return await ping.readiness(drain)

    @routes.get("/health/readiness", responses={503: {"description": "draining, or the database unavailable"}})
    async def litellm_readiness():
        """LiteLLM's readiness: 200 with its body (`db: connected`) while the database answers."""
        answer = await ping.readiness(drain)
        if answer.status_code != 200:
            return answer
        # (no LiteLLM here: no version of it, no cache, no callbacks)
        return {"status": "connected", "db": "connected", "cache": None, "litellm_version": None,
                "success_callbacks": [], "last_updated": dt.datetime.now(dt.timezone.utc).isoformat()}

    @routes.get("/health/live")
    async def live():
        return {"status": "ok"}

    @routes.get("/health/liveliness")  # (LiteLLM's names for a liveness probe, and its answer)
    @routes.get("/health/liveness")
    async def liveliness():
        return LIVELINESS

    @routes.get("/health/backends", dependencies=[Depends(auth.require_master)])
    async def backends():
        return [{"model": b.model, "url": b.name, "healthy": b.healthy, "circuit": b.breaker.state,
                 "outstanding_requests": b.outstanding, "last_error": b.last_error}
                | ({"queue_depth": b.queue_depth, "consumers": b.consumers} if b.consumers is not None else {})
                for b in router.backends()]

    @routes.get("/metrics", dependencies=[Depends(auth.require_master)])
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return routes


class DatabasePing:
    """Readiness's `SELECT 1`, one in flight at a time: probes that come while it runs wait for the
    same one (a database that does not answer holds one worker thread, not one more per probe)."""

    def __init__(self, db: Database):
        self.db, self.pending = db, None

    async def readiness(self, drain: Drain) -> Response:
        """`/health/ready`'s answer: 503 while draining or while the database does not answer."""
        if not drain.draining and not await self.answers():
            return error_response(503, "the gateway's database is unavailable", code="database_unavailable")
        return readiness(drain)

    async def answers(self) -> bool:
        """Whether the database answers within PING_TIMEOUT (its thread is not waited for past it)."""
        if self.pending is None or self.pending.done():
            self.pending = asyncio.get_running_loop().run_in_executor(None, self.db.ping)
        try:
            await asyncio.wait_for(asyncio.shield(self.pending), PING_TIMEOUT)
        except Exception as exc:  # (whatever the driver raises: not ready)
            log.warning("readiness: the database did not answer SELECT 1 (%s)", type(exc).__name__)
            return False
        return True


async def _json_body(request: Request) -> dict:
    raw = await read_body(request, MAX_BODY_BYTES)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # (json's C parser recurses once per level of nesting: a 500 before)
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "treeserve-gateway"}
