"""The database engine for a gateway URL: SQLite set up for several writers (WAL, writers take the
lock at BEGIN), or a pooled PostgreSQL engine."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from sqlalchemy import Engine, create_engine, event


def default_url(directory: Path | None = None) -> str:
    return f"sqlite:///{(directory or Path.cwd()) / 'treeserve-gateway.db'}"


def _wal(cursor, timeout: float = 30.0) -> None:
    """WAL mode (it stays with the file). Switching to it needs the database to itself and SQLite
    answers 'locked' at once instead of waiting, so processes opening a new file together retry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() == "wal":
                return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise sqlite3.OperationalError("could not switch the database to WAL mode")
        time.sleep(0.02)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_setup(dbapi_connection, _):
            dbapi_connection.isolation_level = None  # the driver's own BEGIN would be deferred
            cursor = dbapi_connection.cursor()
            _wal(cursor)
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            # writers take the write lock up front (a deferred BEGIN that reads first fails, not
            # waits, when another writer got there); readers do not block anyone (WAL)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("writing") else "BEGIN")

        return engine
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)
