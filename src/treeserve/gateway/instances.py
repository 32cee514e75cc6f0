"""Gateway processes sharing one database: each says every few seconds that it is alive, and what a
process that fell silent held (its requests' reservations and parallel slots) is given back."""
from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections import defaultdict

from sqlalchemy import delete, select, text, update

from treeserve.gateway.database import Database
from treeserve.gateway.schema import ApiKey, Holding, Instance, Team, User, team_row, user_row, utcnow
from treeserve.gateway.settlement import lock_keys, locked_in_order

log = logging.getLogger("treeserve.gateway")
INSTANCE_TIMEOUT = 60.0  # a process silent this long is dead: its holdings are given back
BEAT_TIMEOUT = 15.0  # seconds a beat may wait on PostgreSQL before it fails (and is tried again, newer)
SWEEP_LOCK = 0x73776570  # PostgreSQL advisory lock id ("swep"): one process sweeps at a time


class Instances:
    def __init__(self, db: Database):
        self.db = db
        self.instance_id = uuid.uuid4().hex  # this process's

    def heartbeat(self) -> None:
        """This process is alive (its holdings are its own to settle): its row alone is written, so a
        beat waits on no lock but a sweep's deleting it (LOCK ORDER: nothing after it). On PostgreSQL
        a beat waits BEAT_TIMEOUT at most: one that waits longer carries a stale `seen_at`. Its connection
        is its own (Database.transaction_apart): requests waiting on a locked key may hold the pool's."""
        with self.db.transaction_apart() as conn:
            if self.db.dialect == "postgresql":
                conn.execute(text(f"SET LOCAL statement_timeout = {int(BEAT_TIMEOUT * 1000)}"))
            seen_at = utcnow()
            insert = self.db.insert(Instance)
            conn.execute(insert.values(instance_id=self.instance_id, seen_at=seen_at).on_conflict_do_update(
                index_elements=["instance_id"], set_={"seen_at": seen_at}))

    def sweep(self) -> int:
        """Gives back what dead gateway processes held (silent for INSTANCE_TIMEOUT): their
        reservations on keys and users and their parallel slots. Returns the holdings given back."""
        cutoff = utcnow() - dt.timedelta(seconds=INSTANCE_TIMEOUT)
        with self.db.transaction() as conn:
            if not self._sweeping(conn):  # (another process is: both would give the same holdings back)
                return 0
            live = select(Instance.instance_id).where(Instance.seen_at >= cutoff)
            found = conn.execute(select(Holding.id, Holding.key_id).where(
                Holding.instance_id.not_in(live), Holding.instance_id != self.instance_id,
                Holding.created_at < cutoff)).all()
            dead = _locked_holdings(conn, found)
            _give_back(conn, dead)
            if dead:
                conn.execute(delete(Holding).where(Holding.id.in_([h.id for h in dead])))
                log.warning("gave back %d requests' holdings of gateway processes gone silent", len(dead))
            conn.execute(delete(Instance).where(Instance.seen_at < cutoff))
        return len(dead)

    def _sweeping(self, conn) -> bool:
        """This transaction is the only sweep until it ends. PostgreSQL: two sweeps at once (read
        committed) both read a dead process's holdings before either deletes them, and each gave them
        back (the keys', users' and teams' `reserved` below 0); SQLite's writers already queue at BEGIN."""
        if self.db.dialect != "postgresql":
            return True
        return bool(conn.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": SWEEP_LOCK}))


def _locked_holdings(conn, found: list) -> list[Holding]:
    """The holdings `found` (id, key_id) as they are now, read again once their keys' rows are held
    (settlement.locked_in_order's LOCK ORDER: keys by id, and each holding after its key). Their
    owner, silent but not dead (its event loop stuck a while, its beats failing), may release or settle
    them meanwhile: both write the key's row first. Given back as first read, a holding released (cut
    to its real cost, its slot freed) or settled (deleted) between that read and the sweep's writes
    was given back twice on PostgreSQL, its key's `reserved` and `in_flight` below 0."""
    if not found:
        return []
    lock_keys(conn, {h.key_id for h in found})
    return list(conn.scalars(select(Holding).where(Holding.id.in_([h.id for h in found]))
                             .order_by(Holding.id).with_for_update()))


def _give_back(conn, holdings: list[Holding]) -> None:
    """The holdings' reservations and parallel slots, off their keys, users and teams."""
    keys: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    users: dict[tuple[str, str | None], float] = defaultdict(float)  # by (id, incarnation)
    teams: dict[tuple[str, str | None], float] = defaultdict(float)
    for holding in holdings:
        keys[holding.key_id][0] += holding.worst_cost
        keys[holding.key_id][1] += int(holding.parallel)
        if holding.user_id is not None:
            users[(holding.user_id, holding.user_incarnation)] += holding.worst_cost
        if holding.team_id is not None:
            teams[(holding.team_id, holding.team_incarnation)] += holding.worst_cost
    for key_id, (released, slots) in sorted(keys.items()):  # (settlement.locked_in_order's LOCK ORDER)
        conn.execute(update(ApiKey).where(ApiKey.id == key_id)
                     .values(reserved=ApiKey.reserved - released, in_flight=ApiKey.in_flight - slots))
    for (user_id, incarnation), released in locked_in_order(users):  # (one made again since: not this one)
        conn.execute(update(User).where(user_row(user_id, incarnation)).values(reserved=User.reserved - released))
    for (team_id, incarnation), released in locked_in_order(teams):
        conn.execute(update(Team).where(team_row(team_id, incarnation)).values(reserved=Team.reserved - released))
