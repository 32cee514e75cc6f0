"""The Files API's rows: files uploaded for batches and the batches' output and error files, in the
gateway's database, each readable only with the key that owns it (another key's file is answered as
one that does not exist). Calls are blocking: the routes run them in worker threads."""
from __future__ import annotations

import uuid

from sqlalchemy import and_, delete, insert, or_, select

from treeserve.gateway.database import Database
from treeserve.gateway.errors import FileNotFound
from treeserve.gateway.schema import StoredFile, aware, utcnow

MAX_FILE_BYTES = 64 << 20
PURPOSES = ("batch",)  # what a client may upload; `batch_output` files are the gateway's own
LISTED = 10_000  # files a page may hold at most


def _mine(file_id: str, owner: int | None):
    return and_(StoredFile.id == file_id,
                StoredFile.api_key_id.is_(None) if owner is None else StoredFile.api_key_id == owner)


def past(created_at, row_id, anchor, ascending: bool = False):
    """The rows after `anchor` (its created_at and id) in a listing newest first (or oldest first,
    `ascending`), ties broken by id: a page's `after`."""
    if ascending:
        return or_(created_at > anchor.created_at, and_(created_at == anchor.created_at, row_id > anchor.id))
    return or_(created_at < anchor.created_at, and_(created_at == anchor.created_at, row_id < anchor.id))


def page(data: list[dict], limit: int) -> dict:
    """A list answer from up to `limit + 1` objects read (one more says whether there are more)."""
    return {"object": "list", "data": data[:limit], "first_id": data[0]["id"] if data else None,
            "last_id": data[:limit][-1]["id"] if data else None, "has_more": len(data) > limit}


def file_object(row) -> dict:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": int(aware(row.created_at).timestamp()),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


class Files:
    def __init__(self, db: Database):
        self.db = db

    def create(self, owner: int | None, purpose: str, filename: str, content: bytes) -> dict:
        with self.db.transaction() as conn:
            return self.insert(conn, owner, purpose, filename, content)

    @staticmethod
    def insert(conn, owner: int | None, purpose: str, filename: str, content: bytes) -> dict:
        """The file written in the caller's transaction (a batch's output files go with its last change)."""
        values = dict(id=f"file-{uuid.uuid4().hex}", api_key_id=owner, purpose=purpose, filename=filename[:256],
                      bytes=len(content), content=content, created_at=utcnow())
        conn.execute(insert(StoredFile).values(**values))
        return file_object(_Row(values))

    def get(self, file_id: str, owner: int | None, param: str = "file_id") -> dict:
        with self.db.session() as conn:
            row = conn.execute(select(*_COLUMNS).where(_mine(file_id, owner))).first()
        if row is None:
            raise FileNotFound(file_id, param)
        return file_object(row)

    def content(self, file_id: str, owner: int | None, param: str = "file_id") -> bytes:
        with self.db.session() as conn:
            content = conn.scalar(select(StoredFile.content).where(_mine(file_id, owner)))
        if content is None:
            raise FileNotFound(file_id, param)
        return content

    def list(self, owner: int | None, purpose: str | None = None, after: str | None = None,
             limit: int = LISTED, order: str = "desc") -> dict:
        """A page of the key's files, newest first (`order="asc"`: oldest first), after the file `after`."""
        limit = max(1, min(limit, LISTED))
        query = select(*_COLUMNS).where(StoredFile.api_key_id.is_(None) if owner is None
                                        else StoredFile.api_key_id == owner)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        newer = order == "asc"
        with self.db.session() as conn:
            if after is not None:
                anchor = conn.execute(select(StoredFile.created_at, StoredFile.id).where(_mine(after, owner))).first()
                if anchor is None:
                    raise FileNotFound(after, "after")
                query = query.where(past(StoredFile.created_at, StoredFile.id, anchor, ascending=newer))
            keys = (StoredFile.created_at, StoredFile.id) if newer else (StoredFile.created_at.desc(),
                                                                         StoredFile.id.desc())
            data = [file_object(row) for row in conn.execute(query.order_by(*keys).limit(limit + 1))]
        return page(data, limit)

    def delete(self, file_id: str, owner: int | None) -> dict:
        with self.db.transaction() as conn:
            if conn.execute(delete(StoredFile).where(_mine(file_id, owner))).rowcount == 0:
                raise FileNotFound(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


_COLUMNS = (StoredFile.id, StoredFile.bytes, StoredFile.created_at, StoredFile.filename, StoredFile.purpose)


class _Row:
    def __init__(self, values: dict):
        self.__dict__.update(values)
