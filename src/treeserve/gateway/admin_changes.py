"""What the admin routers (keys and users, teams) do around an account change: the change run in a
worker thread, this process's cached keys forgotten after it (they carry their user's and team's
models, budget and blocked state), models checked against those served, and a warning where a
budget is set while no model has a price (it would never act)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from treeserve.gateway.pricing import NO_PRICES
from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.gateway")


@dataclass
class AccountChanges:
    known_models: set[str]
    on_change: Callable[[], None] = field(default=lambda: None)
    priced: bool = True

    async def changing(self, work: Callable[[], Any]) -> Any:
        """`work` in a worker thread; this process forgets its cached keys after it, done or not."""
        try:
            return await run_in_threadpool(work)
        finally:
            self.on_change()

    def check_models(self, models: list[str] | None) -> None:
        unknown = [m for m in models or () if m not in self.known_models]
        if unknown:
            raise APIError(400, f"models: {unknown[0]!r} is not served by this gateway", param="models",
                           code="model_not_found")

    def budget_warning(self, answer: dict, max_budget: float | None, owner: str) -> dict:
        if max_budget is not None and not self.priced:
            answer["warning"] = f"max_budget {max_budget} set on a {owner}, but {NO_PRICES}"
            log.warning(answer["warning"])
        return answer
