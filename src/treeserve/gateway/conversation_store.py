"""The Conversations API's conversations in the gateway's database, per key, as stored responses are
(gateway/response_store.py): a conversation made with one key is answered as missing (404) to every
other. Items are rows of their own, in the order added (`position`), so adding some writes only
them. The calls run in worker threads."""
from __future__ import annotations

import datetime as dt

from sqlalchemy import and_, delete, func, insert, select, update
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.database import Database
from treeserve.gateway.schema import ApiConversation as Row
from treeserve.gateway.schema import ApiConversationItem as ItemRow
from treeserve.gateway.schema import aware
from treeserve.wire.conversations import check_append, conversation_object


def _mine(conversation_id: str, owner: int | None):
    return and_(Row.id == conversation_id, Row.api_key_id.is_(None) if owner is None else Row.api_key_id == owner)


def _shown(row) -> dict:
    return conversation_object(row.id, int(aware(row.created_at).timestamp()), row.meta)


def _readable(*ids: str) -> bool:
    """Whether ids may be looked up (no stored id has a NUL, and PostgreSQL refuses one in a text field: a 500)."""
    return all("\x00" not in value for value in ids)


class DatabaseConversationStore:
    """`owner`: the key's id (None: the master key)."""

    def __init__(self, db: Database):
        self.db = db

    async def create(self, conversation: dict, items: list[dict], owner: int | None) -> None:
        await run_in_threadpool(self._create, conversation, items, owner)

    async def get(self, conversation_id: str, owner: int | None) -> dict | None:
        return await run_in_threadpool(self._get, conversation_id, owner) if _readable(conversation_id) else None

    async def set_metadata(self, conversation_id: str, metadata: dict, owner: int | None) -> dict | None:
        if not _readable(conversation_id):
            return None
        return await run_in_threadpool(self._set_metadata, conversation_id, metadata, owner)

    async def delete(self, conversation_id: str, owner: int | None) -> bool:
        return _readable(conversation_id) and await run_in_threadpool(self._delete, conversation_id, owner)

    async def items(self, conversation_id: str, owner: int | None) -> list[dict] | None:
        return await run_in_threadpool(self._items, conversation_id, owner) if _readable(conversation_id) else None

    async def append(self, conversation_id: str, items: list[dict], owner: int | None, limit: int | None) -> bool:
        return _readable(conversation_id) and await run_in_threadpool(self._append, conversation_id, items, owner,
                                                                       limit)

    async def delete_item(self, conversation_id: str, item_id: str, owner: int | None) -> bool:
        return _readable(conversation_id, item_id) and await run_in_threadpool(
            self._delete_item, conversation_id, item_id, owner)

    def _create(self, conversation: dict, items: list[dict], owner: int | None) -> None:
        created = dt.datetime.fromtimestamp(conversation["created_at"], dt.timezone.utc)
        with self.db.transaction() as conn:
            conn.execute(insert(Row).values(id=conversation["id"], api_key_id=owner, meta=conversation["metadata"],
                                            created_at=created))
            _insert_items(conn, conversation["id"], items)

    def _get(self, conversation_id: str, owner: int | None) -> dict | None:
        with self.db.session() as conn:
            row = conn.execute(select(Row.id, Row.created_at, Row.meta).where(_mine(conversation_id, owner))).first()
        return _shown(row) if row is not None else None

    def _set_metadata(self, conversation_id: str, metadata: dict, owner: int | None) -> dict | None:
        with self.db.transaction() as conn:
            conn.execute(update(Row).where(_mine(conversation_id, owner)).values(meta=metadata))
            row = conn.execute(select(Row.id, Row.created_at, Row.meta).where(_mine(conversation_id, owner))).first()
        return _shown(row) if row is not None else None

    def _delete(self, conversation_id: str, owner: int | None) -> bool:
        with self.db.transaction() as conn:
            if conn.execute(select(func.count()).select_from(Row).where(_mine(conversation_id, owner))).scalar() == 0:
                return False
            conn.execute(delete(ItemRow).where(ItemRow.conversation_id == conversation_id))
            return conn.execute(delete(Row).where(_mine(conversation_id, owner))).rowcount > 0

    def _items(self, conversation_id: str, owner: int | None) -> list[dict] | None:
        with self.db.session() as conn:
            if conn.execute(select(Row.id).where(_mine(conversation_id, owner))).first() is None:
                return None
            return list(conn.execute(select(ItemRow.item).where(ItemRow.conversation_id == conversation_id)
                                     .order_by(ItemRow.position)).scalars())

    def _append(self, conversation_id: str, items: list[dict], owner: int | None, limit: int | None) -> bool:
        """The conversation's row locked (PostgreSQL; SQLite's writers queue), so appends to it check and
        write one at a time, and one racing a delete finds it or finds it gone."""
        with self.db.transaction() as conn:
            if conn.execute(select(Row.id).where(_mine(conversation_id, owner)).with_for_update()).first() is None:
                return False
            ids = [item["id"] for item in items]
            held = conn.execute(select(func.count()).select_from(ItemRow)
                                .where(ItemRow.conversation_id == conversation_id)).scalar()
            taken = set(conn.execute(select(ItemRow.item_id).where(ItemRow.conversation_id == conversation_id,
                                                                   ItemRow.item_id.in_(ids))).scalars())
            check_append(held, [item_id for item_id in ids if item_id in taken], len(items), limit)
            _insert_items(conn, conversation_id, items)
        return True

    def _delete_item(self, conversation_id: str, item_id: str, owner: int | None) -> bool:
        with self.db.transaction() as conn:
            if conn.execute(select(Row.id).where(_mine(conversation_id, owner))).first() is None:
                return False
            return conn.execute(delete(ItemRow).where(ItemRow.conversation_id == conversation_id,
                                                      ItemRow.item_id == item_id)).rowcount > 0


def _insert_items(conn, conversation_id: str, items: list[dict]) -> None:
    if items:
        conn.execute(insert(ItemRow), [{"conversation_id": conversation_id, "item_id": item["id"], "item": item}
                                       for item in items])
