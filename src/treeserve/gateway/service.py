"""The gateway's request path. One OpenAI request on a key's account: its model checked (404 unknown,
401 not allowed to the key, its team or its user, as LiteLLM's proxy answers), admitted in one database
transaction (parallel slot, the minute's request count, the worst-case cost reserved on its key and user:
refused with a domain error), forwarded (`proxy.Forwarder`), and settled to its real cost once it has ended (`Accounting`).

The OpenAI routes and the web chat both send their requests through `GatewayService.dispatch`."""
from __future__ import annotations

import logging
import time

from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from treeserve.gateway import pricing
from treeserve.gateway.accounting import Accounting, Admitted
from treeserve.gateway.admission import Admission
from treeserve.gateway.config import GatewayConfig
from treeserve.gateway.errors import GatewayError
from treeserve.gateway.http_errors import to_api_error
from treeserve.gateway.keys import KeyRecord
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.proxy import Forwarder, new_request_id
from treeserve.gateway.routing import Router, affinity_key
from treeserve.gateway.settlement import Reservation
from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.gateway")
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/search": "search",
          "/v1/rewards": "rewards"}


class GatewayService:
    def __init__(self, config: GatewayConfig, router: Router, metrics: GatewayMetrics, admission: Admission,
                 accounting: Accounting, forwarder: Forwarder):
        self.config, self.router, self.metrics = config, router, metrics
        self.admission, self.accounting, self.forwarder = admission, accounting, forwarder

    async def dispatch(self, path: str, body: dict, key: KeyRecord, batch_line: tuple[str, int] | None = None,
                       request_id: str | None = None) -> Response:
        """One OpenAI request on `key`'s account: checked, admitted, forwarded, settled. Refusals
        raise APIError (the request) or a GatewayError (admission); a backend's own error comes
        back as its response. A batch's request names its line: its answer is written with its
        settlement (gateway/settlement.py), and it goes with an Idempotency-Key of its line (a
        treeserve server answers a repeat from the first run: server/idempotency.py)."""
        started = time.perf_counter()
        request_id = request_id or new_request_id()
        try:
            model = self._checked_model(body, key)
            pricing.check_counts(body, search=path == "/v1/search")
            reservation = await self._admit(path, body, model, key)
        except (APIError, GatewayError) as exc:
            status, code = _refused(exc, request_id, ROUTES[path], key, body)
            self.metrics.key_requests.labels(key.label, code or "refused").inc()
            model = body.get("model")
            if isinstance(model, str) and model in self.config.models:  # (not any name a client sends: unbounded)
                self.metrics.answered(model, "", str(status), time.perf_counter() - started)
            raise
        admitted = Admitted(key, reservation, model, ROUTES[path], bool(body.get("stream")), batch_line=batch_line)
        admitted.request_id = request_id
        headers = {"Idempotency-Key": f"{batch_line[0]}/{batch_line[1]}"} if batch_line is not None else None
        return await self.forwarder.forward(path, body, model, affinity_key(body),
                                            self.accounting.settle_once(admitted), started, admitted.request_id,
                                            headers, has_client=batch_line is None)

    async def count_tokens(self, body: dict, key: KeyRecord) -> Response:
        """A backend's `/tokenize` of a chat's messages and tools: the model checked against the key
        as for a request; neither admitted nor billed (nothing is generated). A refusal is logged and
        carries its request id, as a request's does."""
        request_id = new_request_id()
        try:
            model = self._checked_model(body, key)
        except APIError as exc:
            _refused(exc, request_id, "tokenize", key, body)
            raise

        async def settle(_) -> None:
            return None
        return await self.forwarder.forward("/tokenize", body, model, None, settle, time.perf_counter(), request_id)

    def _checked_model(self, body: dict, key: KeyRecord) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model: this field is required", param="model", code="missing_required_parameter")
        if model not in self.config.models:
            raise APIError(404, f"model: the model {model!r} does not exist", param="model", code="model_not_found")
        for field in ("model", "verifier"):  # a search names its verifier model too
            if isinstance(body.get(field), str):
                _check_access(key, field, body[field])
        return model

    async def _admit(self, path: str, body: dict, model: str, key: KeyRecord) -> Reservation:
        if key.holds_nothing:  # (the master key too) nothing to reserve or count: no trip to a worker thread
            return key.nothing_held()
        search = path == "/v1/search"
        models = [self.config.models[name] for name in self.router.chain(model)]
        worst = max(pricing.worst_cost(body, m, search=search) for m in models)
        tokens = max(pricing.worst_tokens(body, m, search=search) for m in models)
        return await run_in_threadpool(self.admission.admit, key, worst, tokens)


def _check_access(key: KeyRecord, field: str, model: str) -> None:
    """A model the key, its team or its user may not use: LiteLLM's proxy's 401
    `{key,team,user}_model_access_denied`, naming the models that one may use."""
    refuser = key.refuser(model)
    if refuser is not None:
        owner, allowed = refuser
        raise APIError(401, f"{field}: {owner} not allowed to access model. This {owner} can only access "
                            f"models={allowed}. Tried to access {model}", param=field, code="model_not_allowed",
                       error_type=f"{owner}_model_access_denied")


def _refused(exc: APIError | GatewayError, request_id: str, route: str, key: KeyRecord,
             body: dict) -> tuple[int, str | None]:
    """A refusal logged (an answered request is logged when it is settled), its answer to carry the
    request id of its log line (as an answered request's does); its HTTP status and error code."""
    if isinstance(exc, GatewayError):
        exc.request_id = request_id  # (http_errors.to_api_error puts it in the answer's headers)
        error = to_api_error(exc)
    else:
        error = exc
        exc.headers = (exc.headers or {}) | {"x-request-id": request_id}
    log.info("%s %s key=%s model=%s refused %d %s", request_id, route, key.label, body.get("model"), error.status,
             error.code)
    return error.status, error.code
