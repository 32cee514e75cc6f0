"""LiteLLM's team admin API (/team/new, /team/info, /team/list, /team/update, /team/block,
/team/unblock, /team/delete, /team/member_add, /team/member_delete), behind the master key like
every admin route. What LiteLLM's teams have and these lack (team rate limits, member budgets, model
aliases, organizations) is a 400 naming the field, not a value stored and never enforced."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import Field, field_validator
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.admin import Models, Money, Period, UserId, _Body
from treeserve.gateway.admin_changes import AccountChanges
from treeserve.gateway.fields import MAX_IDS, NO_NUL, Text
from treeserve.gateway.ledger import Ledger
from treeserve.gateway.teams import Teams
from treeserve.wire.errors import APIError

TeamId = Annotated[Text, Field(min_length=1, max_length=128)]
# LiteLLM's team fields this gateway does not enforce: refused when given (a limit stored and never
# applied would read as one that holds)
UNBUILT = {"tpm_limit": "team rate limits are not enforced here; set tpm_limit on the team's keys",
           "rpm_limit": "team rate limits are not enforced here; set rpm_limit on the team's keys",
           "max_parallel_requests": "set max_parallel_requests on the team's keys",
           "max_budget_in_team": "member budgets within a team are not built here",
           "user_email": "users here have no email; name them by user_id",
           "organization_id": "this gateway has no organizations",
           "model_aliases": "team model aliases are not built here",
           "guardrails": "this gateway has no guardrails",
           "tags": "tag-based routing and spend tags are not built here",
           "members": "members: use members_with_roles, or /team/member_add",
           "admins": "admins: use members_with_roles, or /team/member_add"}


class Member(_Body):
    user_id: UserId
    role: Literal["admin", "user"] = "user"
    user_email: Any = None


class TeamFields(_Body):
    team_alias: Annotated[Text, Field(max_length=128)] | None = None
    models: Models | None = None
    max_budget: Money | None = None
    budget_duration: Period | None = None
    blocked: bool = None  # (a null is a 400: a team is blocked or it is not)
    metadata: dict[str, Any] | None = None
    tpm_limit: Any = None
    rpm_limit: Any = None
    max_parallel_requests: Any = None
    organization_id: Any = None
    model_aliases: Any = None
    guardrails: Any = None
    tags: Any = None


class NewTeam(TeamFields):
    team_id: TeamId | None = None  # (a UUID when left out, LiteLLM's)
    members_with_roles: list[Member] = Field([], max_length=MAX_IDS)
    members: Any = None
    admins: Any = None


class TeamUpdate(TeamFields):
    team_id: TeamId
    spend: Money = None  # (as a key's: 0 starts the team's spend again; a null is a 400)


class TeamDelete(_Body):
    team_ids: list[TeamId] = Field(min_length=1, max_length=MAX_IDS)


class TeamNamed(_Body):
    team_id: TeamId


class MemberAdd(_Body):
    team_id: TeamId
    member: Member | list[Member]
    max_budget_in_team: Any = None

    @field_validator("member")
    @classmethod
    def _not_too_many(cls, member: Member | list[Member]) -> Member | list[Member]:
        if isinstance(member, list) and len(member) > MAX_IDS:  # (a list bound here would name the union's other arm)
            raise ValueError(f"at most {MAX_IDS} members in one call, got {len(member)}")
        return member


class MemberDelete(_Body):
    team_id: TeamId
    user_id: UserId | None = None
    user_email: Any = None


def team_router(teams: Teams, ledger: Ledger, require_master: Any, known_models: set[str],
                on_change: Callable[[], None] = lambda: None, priced: bool = True) -> APIRouter:
    """`on_change` runs after a team changes (this process forgets cached keys: they carry their team's
    models and whether it is blocked); `priced`: some model has a price (else a team's max_budget never
    acts, and the answer says so, as for a key's or a user's)."""
    router = APIRouter(dependencies=[Depends(require_master)], tags=["admin"])

    changes = AccountChanges(known_models, on_change, priced)
    changing, check_models = changes.changing, changes.check_models

    def budget_warning(answer: dict, max_budget: float | None) -> dict:
        return changes.budget_warning(answer, max_budget, "team")

    def team_fields(fields: dict) -> dict:
        _refuse_unbuilt(fields)
        check_models(fields.get("models"))
        return fields

    @router.post("/team/new")
    async def new_team(body: NewTeam):
        fields = team_fields(body.model_dump(exclude_none=True))
        team_id = fields.pop("team_id", None) or str(uuid.uuid4())
        members = [(m["user_id"], m["role"]) for m in fields.pop("members_with_roles")]
        made = await run_in_threadpool(lambda: teams.create_team(team_id, members, **fields))
        return budget_warning(made, fields.get("max_budget"))

    @router.get("/team/info")
    async def team_info(team_id: str = Query(..., min_length=1, max_length=128, pattern=NO_NUL)):
        await run_in_threadpool(ledger.flush)  # (this process's settlements in flight, in its spend)
        return await run_in_threadpool(teams.team_info, team_id)

    @router.get("/team/list")
    async def list_teams(user_id: str | None = Query(None, max_length=128, pattern=NO_NUL),
                         organization_id: str | None = None):
        _refuse_unbuilt({"organization_id": organization_id} if organization_id is not None else {})
        await run_in_threadpool(ledger.flush)
        return await run_in_threadpool(teams.list_teams, user_id)

    @router.post("/team/update")
    async def update_team(body: TeamUpdate):
        fields = team_fields(body.model_dump(exclude_unset=True))
        team_id = fields.pop("team_id")
        answer = {"team_id": team_id, "data": await changing(lambda: teams.update_team(team_id, **fields))}
        return budget_warning(answer, fields.get("max_budget"))

    @router.post("/team/delete")
    async def delete_teams(body: TeamDelete):
        """LiteLLM's: the teams and every key of theirs (none is left holding a deleted team's models
        and budget), all or none."""
        deleted, keys = await changing(lambda: teams.delete_teams(body.team_ids))
        return {"deleted_teams": deleted, "deleted_keys": keys}

    @router.post("/team/block")
    async def block_team(body: TeamNamed):
        """LiteLLM's: every call of the team's keys stops (401) until /team/unblock; the team's record."""
        return await changing(lambda: teams.update_team(body.team_id, blocked=True))

    @router.post("/team/unblock")
    async def unblock_team(body: TeamNamed):
        return await changing(lambda: teams.update_team(body.team_id, blocked=False))

    @router.post("/team/member_add")
    async def member_add(body: MemberAdd):
        _refuse_unbuilt(body.model_dump(exclude_none=True, include={"max_budget_in_team"}))
        added = body.member if isinstance(body.member, list) else [body.member]
        for member in added:
            _refuse_unbuilt(member.model_dump(exclude_none=True, include={"user_email"}))
        team, users = await run_in_threadpool(lambda: teams.add_members(body.team_id,
                                                                        [(m.user_id, m.role) for m in added]))
        return {**team, "updated_users": users, "updated_team_memberships": []}

    @router.post("/team/member_delete")
    async def member_delete(body: MemberDelete):
        _refuse_unbuilt(body.model_dump(exclude_none=True, include={"user_email"}))
        if body.user_id is None:
            raise APIError(400, "user_id: name the member to remove", param="user_id",
                           code="missing_required_parameter")
        return await run_in_threadpool(lambda: teams.delete_member(body.team_id, body.user_id))

    return router


def _refuse_unbuilt(fields: dict) -> None:
    for name in UNBUILT:
        if fields.get(name) is not None:
            raise APIError(400, f"{name}: {UNBUILT[name]}", param=name, code="unsupported_parameter")
