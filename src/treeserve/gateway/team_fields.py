"""The fields of teams: what an admin may set, and what the admin API shows of a team (LiteLLM's
team row, with its `members_with_roles`)."""
from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from treeserve.errors import ParamError
from treeserve.gateway.keys import after
from treeserve.gateway.schema import Team, TeamMember, iso, money

TEAM_FIELDS = ("team_alias", "models", "max_budget", "budget_duration", "blocked", "metadata", "spend")


def team_values(fields: dict, now: dt.datetime) -> dict:
    """A team's columns from the fields given (a budget period given starts now; one cleared stops)."""
    unknown = sorted(set(fields) - set(TEAM_FIELDS))
    if unknown:
        raise ParamError(unknown[0], f"{unknown[0]}: not a team field")
    values = {k: v for k, v in fields.items() if k != "metadata"}
    if "metadata" in fields:
        values["extra"] = fields["metadata"] or {}
    if "budget_duration" in values:
        duration = values["budget_duration"]
        values["budget_reset_at"] = after(now, duration, "budget_duration") if duration else None
    return values


def public_team(team: Team, members: list[TeamMember]) -> dict:
    return {"team_id": team.team_id, "team_alias": team.team_alias, "models": team.models or [],
            "max_budget": team.max_budget, "spend": money(team.spend), "reserved": money(team.reserved),
            "budget_duration": team.budget_duration, "budget_reset_at": iso(team.budget_reset_at),
            "blocked": team.blocked, "metadata": team.extra or {}, "created_at": iso(team.created_at),
            "members_with_roles": [{"user_id": m.user_id, "role": m.role, "user_email": None} for m in members]}


def members_of(conn: Session, team_ids: list[str]) -> dict[str, list[TeamMember]]:
    rows = conn.scalars(select(TeamMember).where(TeamMember.team_id.in_(team_ids))
                        .order_by(TeamMember.created_at, TeamMember.user_id)).all()
    found: dict[str, list[TeamMember]] = {}
    for row in rows:
        found.setdefault(row.team_id, []).append(row)
    return found


def of_member(user_id: str):
    """The condition on teams that `user_id` is a member of."""
    return Team.team_id.in_(select(TeamMember.team_id).where(TeamMember.user_id == user_id))


def public_teams(conn: Session, teams: list[Team]) -> list[dict]:
    """`teams` as the admin API shows them, each with its members."""
    members = members_of(conn, [t.team_id for t in teams])
    return [public_team(t, members.get(t.team_id, [])) for t in teams]


def teams_of(conn: Session, user_id: str) -> list[dict]:
    """The teams `user_id` is a member of (LiteLLM's /user/info `teams`)."""
    return public_teams(conn, conn.scalars(select(Team).where(of_member(user_id)).order_by(Team.created_at)).all())
