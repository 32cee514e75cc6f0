"""The Responses API's stored responses in the gateway's database, per key: a response made with
one key is answered as missing (404) to every other, so ids cannot be probed across keys. The
calls run in worker threads."""
from __future__ import annotations

from sqlalchemy import and_, delete, insert, select
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.database import Database
from treeserve.gateway.schema import StoredResponse as Row
from treeserve.gateway.schema import utcnow
from treeserve.wire.responses_api import StoredResponse


def _mine(response_id: str, owner: int | None):
    return and_(Row.id == response_id, Row.api_key_id.is_(None) if owner is None else Row.api_key_id == owner)


class DatabaseResponseStore:
    """`owner`: the key's id (None: the master key)."""

    def __init__(self, db: Database):
        self.db = db

    async def get(self, response_id: str, owner: int | None) -> StoredResponse | None:
        if "\x00" in response_id:  # (no stored id has one, and PostgreSQL refuses it in a text field: a 500)
            return None
        return await run_in_threadpool(self._get, response_id, owner)

    async def put(self, stored: StoredResponse, owner: int | None) -> None:
        await run_in_threadpool(self._put, stored, owner)

    async def delete(self, response_id: str, owner: int | None) -> bool:
        return await run_in_threadpool(self._delete, response_id, owner)

    def _get(self, response_id: str, owner: int | None) -> StoredResponse | None:
        with self.db.session() as conn:
            row = conn.execute(select(Row.response, Row.history, Row.input_items)
                               .where(_mine(response_id, owner))).first()
        return StoredResponse(row.response, row.history, row.input_items) if row is not None else None

    def _put(self, stored: StoredResponse, owner: int | None) -> None:
        with self.db.transaction() as conn:
            conn.execute(insert(Row).values(id=stored.response["id"], api_key_id=owner, response=stored.response,
                                            history=stored.history, input_items=stored.input_items,
                                            created_at=utcnow()))

    def _delete(self, response_id: str, owner: int | None) -> bool:
        with self.db.transaction() as conn:
            return conn.execute(delete(Row).where(_mine(response_id, owner))).rowcount > 0
