"""The admin API, shaped like LiteLLM's proxy so its users feel at home; every route needs the
master key. Keys are shown once, by /key/generate; afterwards they are known by their hash."""
from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import PlainTextResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.accounts import KEY_SORTS, USER_SORTS, Accounts, Page, Sort
from treeserve.gateway.admin_changes import AccountChanges
from treeserve.gateway.fields import INT32_MAX, MAX_IDS, NO_NUL, Text
from treeserve.gateway.keys import KeyRecord, check_chosen_key, hash_key, same_secret, stored_hash
from treeserve.gateway.ledger import Ledger, logs_csv
from treeserve.gateway.litellm_fields import KEY_UNSUPPORTED, USER_UNSUPPORTED, every_model_as_empty
from treeserve.gateway.passwords import hash_password
from treeserve.wire.errors import APIError
from treeserve.wire.unsupported import drop_or_refuse

# The sizes of their columns (gateway/schema.py): a longer value is a 400 here, not a database error.
UserId = Annotated[Text, Field(min_length=1, max_length=128)]
Money = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Limit = Annotated[int, Field(ge=0, le=INT32_MAX)]
Period = Annotated[Text, Field(max_length=16)]  # "30d"; parsed by keys.after
Models = Annotated[list[Annotated[Text, Field(max_length=256)]], AfterValidator(every_model_as_empty)]
ChosenKey = Annotated[Text, Field(max_length=512), AfterValidator(check_chosen_key)]  # (keys.check_chosen_key)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeyLimits(_Body):
    key_alias: Annotated[Text, Field(max_length=128)] | None = None
    user_id: UserId | None = None
    team_id: Annotated[Text, Field(min_length=1, max_length=128)] | None = None  # (held to its models and budget)
    models: Models | None = None
    max_budget: Money | None = None
    soft_budget: Money | None = None
    budget_duration: Period | None = None
    rpm_limit: Limit | None = None
    tpm_limit: Limit | None = None
    max_parallel_requests: Limit | None = None
    duration: Period | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _litellms_unbuilt(cls, data: Any) -> Any:
        return drop_or_refuse(data, KEY_UNSUPPORTED)


class KeyCreate(KeyLimits):
    """LiteLLM's /key/generate: the key's fields, and `key`, a secret of the admin's choosing (a key
    brought from another gateway; LiteLLM's rule: it starts `sk-`), else a random one."""
    key: ChosenKey | None = None


class KeyUpdate(KeyLimits):
    key: Annotated[Text, Field(max_length=512)]
    blocked: bool = None  # (a null is a 400: a key is blocked or it is not)
    spend: Money = None  # (LiteLLM's: 0 starts the key's spend again; a null is a 400, not a spend of nothing)


class KeyRef(_Body):
    key: Annotated[Text, Field(max_length=512)]  # the key, or its hash as /key/list shows it


class KeyRegenerate(KeyUpdate):
    """LiteLLM's: the key (here or in the path), an optional `new_key` of the admin's choosing, and
    any of /key/update's fields, changed in the same call."""
    key: Annotated[Text, Field(max_length=512)] | None = None
    new_key: ChosenKey | None = None
    new_master_key: Text | None = None  # (refused: the master key is the gateway's configuration)


class KeyDelete(_Body):
    """LiteLLM's: the keys (or their hashes), their aliases, or both; at least one."""
    keys: Annotated[list[Annotated[Text, Field(max_length=512)]], Field(max_length=MAX_IDS)] = []
    key_aliases: Annotated[list[Annotated[Text, Field(max_length=128)]], Field(max_length=MAX_IDS)] = []


class UserFields(_Body):
    max_budget: Money | None = None
    budget_duration: Period | None = None
    models: Models | None = None
    metadata: dict[str, Any] | None = None
    password: Annotated[Text, Field(max_length=1024)] | None = None  # for the web chat (an Argon2id hash)

    @model_validator(mode="before")
    @classmethod
    def _litellms_unbuilt(cls, data: Any) -> Any:
        return drop_or_refuse(data, USER_UNSUPPORTED)


# /user/new's fields for the key it makes (a user here has no rate limits or lifetime of its own)
NEW_USER_KEY_FIELDS = ("key_alias", "duration", "rpm_limit", "tpm_limit", "max_parallel_requests")


class NewUser(UserFields):
    """LiteLLM's: `user_id` (a UUID when left out), and a key for the user made with it unless
    `auto_create_key` is false: with the user's models and metadata, and the key fields given."""
    user_id: UserId | None = None
    auto_create_key: bool = True
    key_alias: Annotated[Text, Field(max_length=128)] | None = None
    duration: Period | None = None
    rpm_limit: Limit | None = None
    tpm_limit: Limit | None = None
    max_parallel_requests: Limit | None = None


class UserUpdate(UserFields):
    user_id: UserId
    spend: Money = None  # (as the key's)


class UserDelete(_Body):
    user_ids: list[UserId] = Field(min_length=1, max_length=MAX_IDS)


def admin_router(accounts: Accounts, ledger: Ledger, require_master: Any, known_models: set[str],
                 on_change: Callable[[], None] = lambda: None, priced: bool = True,
                 master_key: str | None = None) -> APIRouter:
    """`on_change` runs after a key is updated or deleted (this process forgets cached keys);
    `priced`: some model has a price (else a budget set here never acts, and the answer says so);
    `master_key`: the gateway's, which no key may take as its secret."""
    router = APIRouter(dependencies=[Depends(require_master)], tags=["admin"])

    changes = AccountChanges(known_models, on_change, priced)
    changing, check_models, budget_warning = changes.changing, changes.check_models, changes.budget_warning

    def not_the_master(secret: str | None, field: str) -> str | None:
        """A chosen secret, unless it is the master key (a key with it was never used: the master key is
        checked first, and its SHA-256 would be in the database, /key/list and the spend logs)."""
        if secret is not None and master_key and same_secret(secret, master_key):
            raise APIError(400, f"{field}: this is the gateway's master key; a key needs a secret of its own",
                           param=field, code="invalid_value")
        return secret

    @router.post("/key/generate")
    async def generate_key(body: KeyCreate):
        check_models(body.models)
        fields = body.model_dump(exclude_none=True)
        chosen = not_the_master(fields.pop("key", None), "key")
        token, info = await run_in_threadpool(lambda: accounts.create_key(token=chosen, **fields))
        return budget_warning(_issued(token, info), body.max_budget, "key")

    @router.get("/key/list")
    async def list_keys(user_id: str | None = Query(None, max_length=128, pattern=NO_NUL),
                        key_alias: str | None = Query(None, max_length=128, pattern=NO_NUL),
                        key_hash: str | None = Query(None, max_length=512, pattern=NO_NUL,
                                                     description="the key, or its hash"),
                        page: int = Query(1, ge=1, le=INT32_MAX), size: int = Query(10, ge=1, le=100),
                        return_full_object: bool = Query(False, description="each key's record, not its hash"),
                        sort_by: Literal[tuple(KEY_SORTS)] | None = None,
                        sort_order: Literal["asc", "desc"] = "desc",
                        team_id: str | None = Query(None, max_length=128, pattern=NO_NUL),
                        organization_id: str | None = None,
                        include_team_keys: bool = False):
        """LiteLLM's: its filters, pages and answer (`keys` are hashes, records with return_full_object)."""
        _no_teams(organization_id=organization_id, include_team_keys=include_team_keys or None)
        sort = Sort(sort_by, sort_order == "desc") if sort_by else None
        keys, total = await run_in_threadpool(lambda: accounts.find_keys(user_id, key_alias, key_hash, sort,
                                                                         Page(page, size), team_id))
        return {"keys": keys if return_full_object else [k["token"] for k in keys], "total_count": total,
                "current_page": page, "total_pages": _pages(total, size)}

    @router.post("/key/update")
    async def update_key(body: KeyUpdate):
        check_models(body.models)
        fields = body.model_dump(exclude_unset=True)
        token = fields.pop("key")
        return {"key": token, **await changing(lambda: accounts.update_key(token, **fields))}  # (LiteLLM's `key`)

    async def set_blocked(body: KeyRef, blocked: bool) -> dict:
        return await changing(lambda: accounts.update_key(body.key, blocked=blocked))

    @router.post("/key/block")
    async def block_key(body: KeyRef):
        return await set_blocked(body, True)

    @router.post("/key/unblock")
    async def unblock_key(body: KeyRef):
        return await set_blocked(body, False)

    async def regenerate(path_key: str | None, body: KeyRegenerate | None) -> dict:
        """LiteLLM's /key/regenerate: the body's `key` before the path's; its answer is /key/generate's."""
        fields = body.model_dump(exclude_unset=True) if body is not None else {}
        key = fields.pop("key", None) or path_key
        new_key = not_the_master(fields.pop("new_key", None), "new_key")
        if fields.pop("new_master_key", None) is not None:
            raise APIError(400, "new_master_key: the master key is the gateway's configuration (--master-key or "
                           "TREESERVE_MASTER_KEY); restart it with a new one", param="new_master_key",
                           code="unsupported_parameter")
        if not key:
            raise APIError(400, "key: name the key to regenerate (in the path or the body)", param="key",
                           code="missing_required_parameter")
        check_models(fields.get("models"))
        token, info = await changing(lambda: accounts.regenerate_key(key, new_key, **fields))
        return budget_warning(_issued(token, info), fields.get("max_budget"), "key")

    @router.post("/key/regenerate")
    async def regenerate_key(body: KeyRegenerate | None = None):
        return await regenerate(None, body)

    @router.post("/key/{key:path}/regenerate")
    async def regenerate_named_key(key: Annotated[str, Path(max_length=512, pattern=NO_NUL)],
                                   body: KeyRegenerate | None = None):
        return await regenerate(key, body)

    @router.post("/key/delete")
    async def delete_keys(body: KeyDelete):
        if not body.keys and not body.key_aliases:
            raise APIError(400, "keys: name at least one key (or key_aliases: at least one alias)", param="keys",
                           code="missing_required_parameter")
        return {"deleted_keys": await changing(lambda: accounts.delete_keys(body.keys, tuple(body.key_aliases)))}

    async def write_user(write: Callable[..., Any], body: UserFields, fields: dict) -> Any:
        """`write(user_id, password_hash, **fields)` in a worker thread (hashing a password takes
        tens of milliseconds: not on the event loop)."""
        check_models(body.models)
        user_id, password = fields.pop("user_id"), fields.pop("password", None)

        def call() -> Any:
            return write(user_id, hash_password(password) if password is not None else None, **fields)
        return await run_in_threadpool(call)

    @router.post("/user/new")
    async def new_user(body: NewUser):
        fields = body.model_dump(exclude_none=True)
        fields.setdefault("user_id", str(uuid.uuid4()))  # (LiteLLM's)
        key = new_user_key(fields, fields.pop("auto_create_key"))

        def create(user_id: str, password_hash: str | None, **user) -> tuple[str | None, dict]:
            return accounts.create_user_with_key(user_id, password_hash, key, **user)
        token, info = await write_user(create, body, fields)
        return budget_warning(new_user_answer(token, info), body.max_budget, "user")

    @router.get("/user/info")
    async def user_info(user_id: str = Query(..., max_length=128, pattern=NO_NUL)):
        await run_in_threadpool(ledger.flush)
        return await run_in_threadpool(accounts.user_info, user_id)

    @router.post("/user/update")
    async def update_user(body: UserUpdate):
        try:
            answer = await write_user(accounts.update_user, body, body.model_dump(exclude_unset=True))
            answer["data"] = answer["user_info"]  # (LiteLLM's answer: the user's row as `data`)
            return budget_warning(answer, body.max_budget, "user")
        finally:
            on_change()  # (a user's models and budget are read with its keys)

    @router.post("/user/delete")
    async def delete_users(body: UserDelete) -> int:
        """LiteLLM's answer: the number of users deleted (its database's delete count), a bare JSON number."""
        return await changing(lambda: accounts.delete_users(body.user_ids))

    @router.get("/user/list")
    async def list_users(user_ids: str | None = Query(None, max_length=65536, pattern=NO_NUL,
                                                      description="comma-separated"),
                         page: int = Query(1, ge=1, le=INT32_MAX), page_size: int = Query(25, ge=1, le=100),
                         sort_by: Literal[tuple(USER_SORTS)] | None = None,
                         sort_order: Literal["asc", "desc"] = "asc",
                         role: str | None = None, sso_user_ids: str | None = None, user_email: str | None = None,
                         team: str | None = None):
        """LiteLLM's: its filters, pages and answer (users here have no role, email or SSO id; their
        teams are /team/list?user_id=)."""
        _no_teams(role=role, sso_user_ids=sso_user_ids, user_email=user_email, team=team)
        wanted = [u.strip() for u in user_ids.split(",") if u.strip()] if user_ids is not None else None
        if wanted is not None and len(wanted) > MAX_IDS:  # (as a body's list: each id a statement's parameter)
            raise APIError(400, f"user_ids: at most {MAX_IDS} ids in one call, got {len(wanted)}", param="user_ids",
                           code="invalid_value")
        sort = Sort(sort_by, sort_order == "desc") if sort_by else None
        await run_in_threadpool(ledger.flush)
        users, total = await run_in_threadpool(lambda: accounts.list_users(wanted, sort, Page(page, page_size)))
        return {"users": users, "total": total, "page": page, "page_size": page_size,
                "total_pages": _pages(total, page_size)}

    @router.get("/spend/logs")
    async def spend_logs(api_key: str | None = Query(None, max_length=512, pattern=NO_NUL),
                         user_id: str | None = Query(None, max_length=128, pattern=NO_NUL),
                         start_date: dt.date | None = None, end_date: dt.date | None = None,
                         request_id: str | None = Query(None, max_length=128, pattern=NO_NUL),
                         limit: int = Query(1000, ge=1, le=100_000), order: Literal["asc", "desc"] = "asc",
                         format: str = Query("json", pattern="^(json|csv)$")):
        start = _midnight(start_date)
        end = _midnight(_day_after(end_date))
        await run_in_threadpool(ledger.flush)
        rows = await run_in_threadpool(lambda: ledger.spend_logs(api_key, user_id, start, end, limit, request_id,
                                                                 order))
        if format == "csv":
            return PlainTextResponse(logs_csv(rows), media_type="text/csv",
                                     headers={"Content-Disposition": "attachment; filename=spend_logs.csv"})
        return rows

    @router.get("/spend/daily")
    async def daily_spend():
        await run_in_threadpool(ledger.flush)
        return await run_in_threadpool(ledger.daily_spend)

    return router


def key_info_router(accounts: Accounts, ledger: Ledger, require_key: Any) -> APIRouter:
    """GET /key/info: with the master key, any key's (`key`: the key or its hash); with a virtual
    key, its own (LiteLLM's self-service read: `key` left out, or naming itself)."""
    router = APIRouter(tags=["admin"])

    @router.get("/key/info")
    async def key_info(key: str | None = Query(None, max_length=512, pattern=NO_NUL,
                                               description="the key, or its hash as /key/list shows it"),
                       caller: KeyRecord = Depends(require_key)):
        await run_in_threadpool(ledger.flush)  # this process's settlements in flight, committed first
        if caller.id is None:  # the master key
            if key is None:
                raise APIError(400, "key: this field is required (the key, or its hash)", param="key",
                               code="missing_required_parameter")
            return {"key": key, "info": await run_in_threadpool(accounts.key_info, key)}
        info = await run_in_threadpool(lambda: accounts.key_info(key_id=caller.id))
        if key is not None and stored_hash(key) != info["token"]:
            raise APIError(403, "key: a key may read its own info only (the master key reads any)", param="key",
                           code="not_your_key")
        return {"key": key if key is not None else info["token"], "info": info}  # (LiteLLM's: its own hash)

    return router


def _issued(token: str, info: dict) -> dict:
    """A key just made or regenerated: the key itself (shown this once) and its record, its hash also
    as LiteLLM's `token_id`."""
    return {"key": token, "token_id": info["token"], **info}


def new_user_key(fields: dict, auto_create_key: bool) -> dict | None:
    """The fields of the key /user/new makes (None: `auto_create_key` false), taken out of `fields`:
    the key fields given, and the user's models and metadata (LiteLLM's)."""
    key = {name: fields.pop(name) for name in NEW_USER_KEY_FIELDS if name in fields}
    if not auto_create_key:
        if key:
            name = next(iter(key))
            raise APIError(400, f"{name}: a field of the key /user/new makes, but auto_create_key is false",
                           param=name, code="invalid_value")
        return None
    return key | {k: fields[k] for k in ("models", "metadata") if k in fields}


def new_user_answer(token: str | None, info: dict) -> dict:
    """LiteLLM's /user/new answer (the key made, shown this once, and the user's fields), with
    /user/info's (`user_info`, `keys`, `teams`)."""
    user = info["user_info"]
    made = next((k for k in info["keys"] if token and k["token"] == hash_key(token)), {})
    return {"key": token, "key_alias": made.get("key_alias"), "key_name": made.get("key_name"),
            "expires": made.get("expires"), "max_budget": user["max_budget"],
            "budget_duration": user["budget_duration"], "models": user["models"], "metadata": user["metadata"],
            "spend": user["spend"], **info}


def _no_teams(**filters: Any) -> None:
    """A 400 naming a LiteLLM filter this gateway does not have (organizations, roles, emails, a
    user list by team), not a list that silently ignores it."""
    for name, value in filters.items():
        if value is not None:
            raise APIError(400, f"{name}: this filter is not built here (no organizations, roles or emails; "
                           "a team's keys are /key/list?team_id=, a user's teams /team/list?user_id=)",
                           param=name, code="unsupported_parameter")


def _pages(total: int, size: int) -> int:
    return -(-total // size)


def _midnight(day: dt.date | None) -> dt.datetime | None:
    return dt.datetime.combine(day, dt.time(), tzinfo=dt.timezone.utc) if day else None


def _day_after(day: dt.date | None) -> dt.date | None:
    """The next day (the last day there is has none: its range has no end)."""
    return day + dt.timedelta(days=1) if day is not None and day < dt.date.max else None
