"""LiteLLM's teams in the gateway's database: a team's models and budget hold every key made for it
(admission reserves on the team as on a key and its user), its spend is theirs together, and its
members are users with a role. Deleting a team deletes its keys (LiteLLM's /team/delete)."""
from __future__ import annotations

import datetime as dt

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from treeserve.gateway.account_fields import public_key, public_user
from treeserve.gateway.database import Database
from treeserve.gateway.errors import MemberExists, MemberNotFound, TeamExists, TeamNotFound
from treeserve.gateway.schema import ApiKey, Team, TeamMember, User, utcnow
from treeserve.gateway.team_fields import members_of, of_member, public_team, public_teams, team_values


class Teams:
    def __init__(self, db: Database):
        self.db = db

    def create_team(self, team_id: str, members: list[tuple[str, str]], **fields) -> dict:
        """A new team and its members ((user_id, role); a user not yet known is made, as LiteLLM does)."""
        now = utcnow()
        values = team_values(fields, now)
        values.setdefault("extra", {})
        with self.db.transaction() as conn:
            statement = self.db.insert(Team).values(team_id=team_id, spend=0.0, reserved=0.0, created_at=now,
                                                    **{"blocked": False, **values})
            made = conn.execute(statement.on_conflict_do_nothing(index_elements=["team_id"])
                                .returning(Team.team_id)).first()
            if made is None:
                raise TeamExists(team_id)
            self._make_users(conn, [u for u, _ in members], now)
            self._add_members(conn, team_id, members, now)
        return self.team(team_id)

    def team(self, team_id: str) -> dict:
        with self.db.session() as conn:
            return public_team(_team(conn, team_id), members_of(conn, [team_id]).get(team_id, []))

    def team_info(self, team_id: str) -> dict:
        """LiteLLM's /team/info: the team (`team_info`, its `spend` among it), its keys and memberships."""
        with self.db.session() as conn:
            team = _team(conn, team_id)
            members = members_of(conn, [team_id]).get(team_id, [])
            keys = conn.scalars(select(ApiKey).where(ApiKey.team_id == team_id).order_by(ApiKey.id)).all()
        memberships = [{"team_id": team_id, "user_id": m.user_id, "budget_id": None, "spend": 0.0} for m in members]
        return {"team_id": team_id, "team_info": public_team(team, members), "keys": [public_key(k) for k in keys],
                "team_memberships": memberships}

    def list_teams(self, user_id: str | None = None) -> list[dict]:
        """Every team (those `user_id` is a member of, if given), by team_alias as LiteLLM's /team/list."""
        query = select(Team) if user_id is None else select(Team).where(of_member(user_id))
        with self.db.session() as conn:
            return public_teams(conn, conn.scalars(query.order_by(func.coalesce(Team.team_alias, ""),
                                                                  Team.created_at)).all())

    def update_team(self, team_id: str, **fields) -> dict:
        values = team_values(fields, utcnow())
        if values:
            with self.db.transaction() as conn:
                if conn.execute(update(Team).where(Team.team_id == team_id).values(**values)).rowcount == 0:
                    raise TeamNotFound(team_id)
        return self.team(team_id)

    def delete_teams(self, team_ids: list[str]) -> tuple[list[str], int]:
        """All of them with their keys and memberships (LiteLLM's rule), or none (TeamNotFound) when
        any does not exist: (the teams deleted, how many keys went with them)."""
        with self.db.transaction() as conn:
            # the keys' rows locked before the teams': admission and the settlement write a key, then
            # its team; the other order deadlocks with a request on a team key (PostgreSQL aborts one)
            # (each by id: settlement.locked_in_order's LOCK ORDER)
            conn.execute(select(ApiKey.id).where(ApiKey.team_id.in_(team_ids)).order_by(ApiKey.id)
                         .with_for_update()).all()
            found = set(conn.scalars(select(Team.team_id).where(Team.team_id.in_(team_ids)).order_by(Team.team_id)
                                     .with_for_update()))
            missing = [t for t in team_ids if t not in found]
            if missing:
                raise TeamNotFound(missing[0], "team_ids")
            keys = conn.execute(delete(ApiKey).where(ApiKey.team_id.in_(team_ids))).rowcount
            conn.execute(delete(TeamMember).where(TeamMember.team_id.in_(team_ids)))
            conn.execute(delete(Team).where(Team.team_id.in_(team_ids)))
        return sorted(found, key=team_ids.index), keys

    def add_members(self, team_id: str, members: list[tuple[str, str]]) -> tuple[dict, list[dict]]:
        """(the team, the members' users): each added with its role, or none (MemberExists)."""
        now = utcnow()
        with self.db.transaction() as conn:
            self._make_users(conn, [u for u, _ in members], now)  # (users' rows before the team's: LOCK ORDER)
            _team(conn, team_id, lock=True)
            self._add_members(conn, team_id, members, now)
            users = conn.scalars(select(User).where(User.user_id.in_([u for u, _ in members]))).all()
            users = [public_user(u) for u in users]
        return self.team(team_id), users

    def delete_member(self, team_id: str, user_id: str) -> dict:
        with self.db.transaction() as conn:
            _team(conn, team_id, lock=True)
            gone = conn.execute(delete(TeamMember).where(TeamMember.team_id == team_id,
                                                         TeamMember.user_id == user_id)).rowcount
            if not gone:
                raise MemberNotFound(user_id, team_id)
        return self.team(team_id)

    def _make_users(self, conn: Session, user_ids: list[str], now: dt.datetime) -> None:
        """The users not yet known made (as LiteLLM's), by id (settlement.locked_in_order's LOCK ORDER:
        on PostgreSQL the INSERT waits for a transaction writing the row, so it comes before the team's)."""
        for user_id in sorted(set(user_ids)):
            conn.execute(self.db.insert(User).values(user_id=user_id, spend=0.0, reserved=0.0, extra={}, created_at=now)
                         .on_conflict_do_nothing(index_elements=["user_id"]))

    def _add_members(self, conn: Session, team_id: str, members: list[tuple[str, str]], now: dt.datetime) -> None:
        """Each member's row, by user id: each holds its user's row (its foreign key's check, FOR KEY
        SHARE), settlement.locked_in_order's LOCK ORDER; in the order named, a later user's row held while
        an earlier one's was waited for deadlocked with /user/delete of both (their rows by id)."""
        for user_id, role in sorted(members, key=lambda member: member[0]):
            added = conn.execute(self.db.insert(TeamMember).values(team_id=team_id, user_id=user_id, role=role,
                                                                   created_at=now)
                                 .on_conflict_do_nothing(index_elements=["team_id", "user_id"])
                                 .returning(TeamMember.user_id)).first()
            if added is None:
                raise MemberExists(user_id, team_id)


def _team(conn: Session, team_id: str, lock: bool = False) -> Team:
    query = select(Team).where(Team.team_id == team_id)
    team = conn.scalars(query.with_for_update() if lock else query).first()
    if team is None:
        raise TeamNotFound(team_id)
    return team
