"""Settling an admitted request once it has ended: its real cost from its model's prices, its hold
cut to that cost at once, its settlement queued for the ledger's writer, its key's metrics."""
from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from treeserve.gateway import pricing
from treeserve.gateway.admission import Admission
from treeserve.gateway.config import ModelConfig
from treeserve.gateway.keys import KeyRecord
from treeserve.gateway.ledger import Ledger
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.proxy import Outcome, new_request_id
from treeserve.gateway.schema import utcnow
from treeserve.gateway.settlement import Reservation, Settlement

log = logging.getLogger("treeserve.gateway")
Settle = Callable[[Outcome], Awaitable[None]]


@dataclass
class Admitted:
    """A request admitted on its key's account: what its settlement needs to know."""
    key: KeyRecord
    reservation: Reservation
    model: str
    route: str
    stream: bool
    request_id: str = field(default_factory=new_request_id)
    started_at: dt.datetime = field(default_factory=utcnow)
    batch_line: tuple[str, int] | None = None  # (batch id, line) of a batch's request


class Accounting:
    def __init__(self, models: dict[str, ModelConfig], admission: Admission, ledger: Ledger, metrics: GatewayMetrics):
        self.models, self.admission, self.ledger, self.metrics = models, admission, ledger, metrics

    def settle_once(self, admitted: Admitted) -> Settle:
        """The request's settlement, idempotent: the forwarder may call it again on a failure path."""
        done = False

        async def settle(outcome: Outcome) -> None:
            nonlocal done
            if not done:
                done = True
                await self.settle(admitted, outcome)
        return settle

    async def settle(self, admitted: Admitted, outcome: Outcome) -> None:
        model = outcome.model or admitted.model
        usage = outcome.usage
        cost = pricing.cost(self.models[model], usage.prompt_tokens, usage.completion_tokens)
        reservation = admitted.reservation
        try:  # at once: the client's next request must find its slot free, its budget held only for `cost` and
            # its minute's tokens only those it used
            if reservation.parallel or reservation.held or reservation.tokens:
                await run_in_threadpool(self.admission.release, reservation, cost, usage.total_tokens)
        except Exception:  # the slot and the worst case go back with the settlement's batch instead
            log.exception("releasing a request's hold at its answer failed; its settlement gives it back")
        finally:
            self.ledger.settle_later(Settlement(
                reservation, admitted.request_id, model, outcome.backend, admitted.route, admitted.stream,
                outcome.status, usage, cost, admitted.started_at, batch_line=admitted.batch_line,
                answer=outcome.answer if admitted.batch_line is not None else None))
        log.info("%s %s key=%s model=%s backend=%s %s tokens=%d+%d cost=%.6g", admitted.request_id, admitted.route,
                 admitted.key.label, model, outcome.backend, outcome.status, usage.prompt_tokens,
                 usage.completion_tokens, cost)
        self._count(admitted.key, model, outcome, cost)

    def _count(self, key: KeyRecord, model: str, outcome: Outcome, cost: float) -> None:
        self.metrics.key_requests.labels(key.label, outcome.status).inc()
        self.metrics.key_tokens.labels(key.label, model, "prompt").inc(outcome.usage.prompt_tokens)
        self.metrics.key_tokens.labels(key.label, model, "completion").inc(outcome.usage.completion_tokens)
        self.metrics.key_spend.labels(key.label).inc(cost)
