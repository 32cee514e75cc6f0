"""What a team asks of the keys given to it, checked in the transaction that writes the key."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from treeserve.gateway.errors import KeyTeamNotFound, ModelsOutsideTeam
from treeserve.gateway.schema import Team


def check_key_team(conn: Session, team_id: str | None, models: list[str] | None) -> None:
    """The team exists (its row locked until the key is written: a /team/delete at the same time waits,
    then deletes the key with it, so no key outlives its team), and the key's models are the team's."""
    if team_id is None:
        return
    team_models = conn.execute(select(Team.models).where(Team.team_id == team_id).with_for_update()).first()
    if team_models is None:
        raise KeyTeamNotFound(team_id)
    allowed = team_models.models or []
    outside = [m for m in models or () if allowed and m not in allowed]
    if outside:
        raise ModelsOutsideTeam(outside[0], team_id, allowed)
