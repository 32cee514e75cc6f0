"""The admin API, shaped like LiteLLM's proxy so its users feel at home; every route needs the
master key. Keys are shown once, by /key/generate; afterwards they are known by their hash."""
from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.passwords import hash_password
from treeserve.gateway.store import Store, logs_csv
from treeserve.server.errors import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeyLimits(_Body):
    key_alias: str | None = None
    user_id: str | None = None
    models: list[str] | None = None
    max_budget: float | None = Field(None, ge=0)
    budget_duration: str | None = None
    rpm_limit: int | None = Field(None, ge=0)
    tpm_limit: int | None = Field(None, ge=0)
    max_parallel_requests: int | None = Field(None, ge=0)
    duration: str | None = None
    metadata: dict[str, Any] | None = None


class KeyUpdate(KeyLimits):
    key: str
    blocked: bool | None = None


class KeyDelete(_Body):
    keys: list[str] = Field(min_length=1)


class NewUser(_Body):
    user_id: str = Field(min_length=1, max_length=128)
    max_budget: float | None = Field(None, ge=0)
    budget_duration: str | None = None
    models: list[str] | None = None
    metadata: dict[str, Any] | None = None
    password: str | None = None  # for signing in to the web chat (stored as an Argon2id hash)


def admin_router(store: Store, require_master: Any, known_models: set[str],
                 on_change: Callable[[], None] = lambda: None) -> APIRouter:
    """`on_change` runs after a key is updated or deleted (this process forgets cached keys)."""
    router = APIRouter(dependencies=[Depends(require_master)], tags=["admin"])

    def check_models(models: list[str] | None) -> None:
        unknown = [m for m in models or () if m not in known_models]
        if unknown:
            raise APIError(400, f"models: {unknown[0]!r} is not served by this gateway", param="models",
                           code="model_not_found")

    @router.post("/key/generate")
    async def generate_key(body: KeyLimits):
        check_models(body.models)
        token, info = await run_in_threadpool(lambda: store.create_key(**body.model_dump(exclude_none=True)))
        return {"key": token, **info}

    @router.get("/key/info")
    async def key_info(key: str = Query(..., description="the key, or its hash as /key/list shows it")):
        await run_in_threadpool(store.flush)  # this process's settlements in flight, committed first
        return {"key": key if len(key) == 64 else None, "info": await run_in_threadpool(store.key_info, key)}

    @router.get("/key/list")
    async def list_keys(user_id: str | None = None):
        return {"keys": await run_in_threadpool(store.list_keys, user_id)}

    @router.post("/key/update")
    async def update_key(body: KeyUpdate):
        check_models(body.models)
        fields = body.model_dump(exclude_unset=True)
        token = fields.pop("key")
        try:
            return await run_in_threadpool(lambda: store.update_key(token, **fields))
        finally:
            on_change()

    @router.post("/key/delete")
    async def delete_keys(body: KeyDelete):
        try:
            return {"deleted_keys": await run_in_threadpool(store.delete_keys, body.keys)}
        finally:
            on_change()

    @router.post("/user/new")
    async def new_user(body: NewUser):
        check_models(body.models)
        fields = body.model_dump(exclude_none=True)
        user_id = fields.pop("user_id")
        password = fields.pop("password", None)

        def create() -> dict:  # (hashing a password takes tens of milliseconds: not on the event loop)
            password_hash = hash_password(password) if password is not None else None
            return store.create_user(user_id, password_hash=password_hash, **fields)
        return await run_in_threadpool(create)

    @router.get("/user/info")
    async def user_info(user_id: str):
        await run_in_threadpool(store.flush)
        return await run_in_threadpool(store.user_info, user_id)

    @router.get("/spend/logs")
    async def spend_logs(api_key: str | None = None, user_id: str | None = None,
                         start_date: dt.date | None = None, end_date: dt.date | None = None,
                         limit: int = Query(1000, ge=1, le=100_000), format: str = Query("json", pattern="^(json|csv)$")):
        start = _midnight(start_date)
        end = _midnight(end_date + dt.timedelta(days=1)) if end_date else None
        await run_in_threadpool(store.flush)
        rows = await run_in_threadpool(lambda: store.spend_logs(api_key, user_id, start, end, limit))
        if format == "csv":
            return PlainTextResponse(logs_csv(rows), media_type="text/csv",
                                     headers={"Content-Disposition": "attachment; filename=spend_logs.csv"})
        return rows

    @router.get("/spend/daily")
    async def daily_spend():
        await run_in_threadpool(store.flush)
        return await run_in_threadpool(store.daily_spend)

    return router


def _midnight(day: dt.date | None) -> dt.datetime | None:
    return dt.datetime.combine(day, dt.time(), tzinfo=dt.timezone.utc) if day else None
