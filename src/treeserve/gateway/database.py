"""The gateway's database, under all its services: the engine for a URL (SQLite set up for several
writers: WAL, writers take the lock at BEGIN; or a pooled PostgreSQL engine), read sessions, writing
transactions, the dialect's upsert, and the Alembic migrations.

Everything that must hold across several gateway processes is one conditional statement that the
database applies atomically. SQLite runs in WAL mode and takes its write lock at the start of each
transaction (`BEGIN IMMEDIATE`), so concurrent writers queue instead of failing; PostgreSQL locks
the row. Calls are blocking: the app runs them in worker threads."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, exc, text
from sqlalchemy.engine import make_url
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from treeserve.arg_types import without_password
from treeserve.errors import ParamError

DATABASE_VARIABLE = "TREESERVE_GATEWAY_DATABASE"
MIGRATIONS = Path(__file__).parent / "migrations"
PG_CONNECT_TIMEOUT = 10  # seconds
MIGRATION_LOCK = 0x74726565  # PostgreSQL advisory lock id ("tree") serialising migrations
# what a database that does not answer raises (down, unreachable, its connections all taken), and
# more: an OperationalError is also a deadlock or a missing table; `database_down` tells them apart
DATABASE_ERRORS = (exc.OperationalError, exc.InterfaceError, exc.TimeoutError)
# PostgreSQL's SQLSTATEs of a server that cannot serve now: class 08 (connection exceptions), admin or
# crash shutdown, cannot connect now (starting up), too many connections
PG_DOWN_CLASSES = ("08",)
PG_DOWN_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})
# SQLite's messages of a file that cannot be used now (gone, unmounted, locked past the busy timeout)
SQLITE_DOWN = ("unable to open database file", "database is locked", "disk i/o error")
SUPPORTED_DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql+psycopg", "postgresql+psycopg2")


class DatabaseUnreachable(Exception):
    """A database that cannot be reached, named as an error may print it (no password)."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, reason.strip().splitlines()[0]
        super().__init__(f"database {shown_url(url)}: cannot be reached ({self.reason})")


def database_down(error: BaseException) -> bool:
    """Whether `error` says the database cannot be reached or used now (a 503 to retry), not that a
    statement failed in it (a deadlock, a missing table, a cancelled query: a 500)."""
    if isinstance(error, (exc.TimeoutError, exc.InterfaceError)):  # (no pooled connection free; a dead one)
        return True
    if not isinstance(error, exc.OperationalError):
        return False
    orig = error.orig
    if isinstance(orig, sqlite3.Error):
        return any(m in str(orig).lower() for m in SQLITE_DOWN)
    if error.connection_invalidated:
        return True
    state = sqlstate(orig)
    if state is None:  # (no server answered, so no SQLSTATE: refused, unreachable, timed out)
        return True
    return state.startswith(PG_DOWN_CLASSES) or state in PG_DOWN_STATES


def sqlstate(orig: BaseException) -> str | None:
    """PostgreSQL's SQLSTATE of a driver's error: psycopg 3 names it `sqlstate`, psycopg2 `pgcode`."""
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def violates_unique(error: exc.IntegrityError, index: str, column: str) -> bool:
    """Whether `error` is a duplicate in the unique `index` on `column` ("table.column"): PostgreSQL
    names the index (SQLSTATE 23505; both psycopg drivers carry it in `diag`), SQLite the column."""
    orig = error.orig
    if isinstance(orig, sqlite3.Error):
        return f"UNIQUE constraint failed: {column}" in str(orig)
    diag = getattr(orig, "diag", None)
    return sqlstate(orig) == "23505" and getattr(diag, "constraint_name", None) == index


def shown_url(url: str) -> str:
    """`url` as an error may print it: SQLite's file path; another database's URL with its password,
    in the authority or the query string, as ***; one SQLAlchemy cannot parse (no scheme: `user:pw@host/db`)
    with its password as ***, as arg_types.without_password shows any URL."""
    try:
        parsed = make_url(url)
    except exc.ArgumentError:
        return without_password(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.database or ":memory:"
    if "password" in parsed.query:  # (a URL's query quotes its values: %2A for *)
        parsed = parsed.update_query_dict({"password": "HIDDEN"})
    return parsed.render_as_string(hide_password=True).replace("password=HIDDEN", "password=***")


def configured_url(url: str | None) -> str:
    """The gateway's database: `url` (--database, else the config's `database`), else the
    TREESERVE_GATEWAY_DATABASE environment variable, else ./treeserve-gateway.db. The variable set but
    empty is an error naming it, as an empty --database is (it was taken as unset: ./treeserve-gateway.db)."""
    if url:
        return url
    variable = os.environ.get(DATABASE_VARIABLE)
    if variable is not None and not variable.strip():
        raise ParamError(DATABASE_VARIABLE, f"is empty ({variable!r}): give a SQLAlchemy URL, or unset it for "
                         "./treeserve-gateway.db")
    return variable or default_url()


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


def supported_url(url: str) -> str:
    """The URL the engine is made from: SQLite, or PostgreSQL through psycopg 3 (the dependency; a bare
    `postgresql://`, LiteLLM's spelling, means it) or psycopg2 (if installed). Any other driver is
    refused here, at startup: the gateway tells an outage from a failed statement by the SQLSTATE,
    which only these drivers' errors carry where it reads it."""
    try:
        parsed = make_url(url)
    except exc.ArgumentError:  # (SQLAlchemy's error names no URL; it was a traceback)
        raise ValueError(f"database URL {shown_url(url)!r} is not a URL SQLAlchemy reads: use "
                         "postgresql+psycopg://user:pass@host/db or sqlite:///path/to/gateway.db") from None
    if parsed.drivername in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    if parsed.drivername not in SUPPORTED_DRIVERS:
        raise ValueError(f"database URL driver {parsed.drivername!r} is not supported: use "
                         "postgresql+psycopg://user:pass@host/db (or postgresql+psycopg2:// with psycopg2 installed), "
                         "or sqlite:///path/to/gateway.db")
    if parsed.drivername == "postgresql+psycopg2" and importlib.util.find_spec("psycopg2") is None:
        raise ValueError("database URL driver 'postgresql+psycopg2' needs psycopg2, which is not installed: "
                         "use postgresql+psycopg://user:pass@host/db (psycopg 3, installed)")
    return url


def make_engine(url: str, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """`pool_size`, `max_overflow`: PostgreSQL's connection pool (SQLite's is SQLAlchemy's own)."""
    url = supported_url(url)
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
    # (a host that does not answer fails a connection in 10 s, not the system's TCP timeout of minutes)
    connect = {"connect_timeout": PG_CONNECT_TIMEOUT} if url.startswith("postgresql") else {}
    return create_engine(url, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True,
                         connect_args=connect)


class Database:
    """One gateway database, shared by the accounts, admission, ledger and instances services."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        self._writer = self.engine.execution_options(writing=True)
        self._write_lock = threading.Lock() if self.dialect == "sqlite" else contextlib.nullcontext()
        # PostgreSQL: one connection apart from the pool, for `transaction_apart` (connected at its first use)
        self._apart = make_engine(url, pool_size=1, max_overflow=0) if self.dialect == "postgresql" else None

    def reach(self) -> None:
        """Opens a connection and closes it: DatabaseUnreachable where the database cannot be reached."""
        try:
            with self.engine.connect():
                pass
        except DATABASE_ERRORS as error:
            if not database_down(error):
                raise
            raise DatabaseUnreachable(self.url, str(getattr(error, "orig", None) or error)) from error

    def session(self) -> Session:
        """For reads."""
        return Session(self.engine, expire_on_commit=False)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Session]:
        """A transaction that writes. On SQLite this process's writers also queue on a lock first:
        SQLite's own busy handler waits by sleeping (up to 100 ms a turn), a lock hands over at once."""
        with self._write_lock, Session(self._writer, expire_on_commit=False) as session, session.begin():
            yield session

    @contextlib.contextmanager
    def transaction_apart(self) -> Iterator[Session]:
        """`transaction`, on PostgreSQL on a connection no other caller takes (the heartbeat's): requests
        waiting on a locked row in their transactions may hold every connection of the pool, and a
        beat waiting for one behind them (30 s, then failing) made the process look dead. SQLite: the
        same as `transaction` (its writers queue on the write lock before they take a connection)."""
        if self._apart is None:
            with self.transaction() as session:
                yield session
            return
        with Session(self._apart.execution_options(writing=True), expire_on_commit=False) as session, \
                session.begin():
            yield session

    def insert(self, table):
        """The dialect's INSERT, which has `on_conflict_do_update`."""
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table)

    def upsert(self, conn: Session, table, values: dict, keys: list[str], add: list[str], returning: tuple = ()):
        """INSERT, or on a conflict on `keys` add `add`'s values to the row's; the `returning`
        columns of the row written (None when none are asked)."""
        insert = self.insert(table)
        statement = insert.values(**values).on_conflict_do_update(
            index_elements=keys, set_={c: getattr(table, c) + getattr(insert.excluded, c) for c in add})
        if returning:
            return conn.execute(statement.returning(*returning)).first()
        conn.execute(statement)
        return None

    def migrate(self) -> None:
        """Brings the schema to the newest revision (Alembic; a no-op when it is there). Gateway
        processes started together migrate one after another: SQLite's write lock is taken at the
        transaction's start, PostgreSQL's by an advisory lock held to its end."""
        self._run_migrations(command.upgrade, "head")

    def downgrade(self, revision: str) -> None:
        """Takes the schema back to `revision` (`treeserve gateway db downgrade`), as `migrate` takes it
        up: on SQLite with foreign keys off (a revision that rebuilt a table rebuilds it again going
        down, and dropping the old copy with them on deleted its children through ON DELETE CASCADE:
        every key's files, batches and responses, every batch's lines), rolled back if it broke a reference."""
        self._run_migrations(command.downgrade, revision)

    def revision(self) -> str | None:
        """The schema's revision (None: none applied)."""
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def _run_migrations(self, step, revision: str) -> None:
        """`step` (Alembic's upgrade or downgrade) to `revision` in one transaction, one process at a time."""
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with self._writer.connect() as conn, _foreign_keys_off(conn, self.dialect):
            with conn.begin():
                if self.dialect == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
                config.attributes["connection"] = conn
                head = ScriptDirectory.from_config(config).get_current_head()
                current = MigrationContext.configure(conn).get_current_revision()
                checked = self.dialect == "sqlite" and (revision != "head" or current != head)
                before = _broken_references(conn) if checked else 0
                step(config, revision)
                if checked and _broken_references(conn) > before:  # (raised in the transaction: rolled back)
                    raise RuntimeError("a migration left rows whose foreign keys point nowhere; it was rolled back")

    def ping(self) -> None:
        """`SELECT 1`: raises when the database does not answer."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def close(self) -> None:
        self.engine.dispose()
        if self._apart is not None:
            self._apart.dispose()


@contextlib.contextmanager
def _foreign_keys_off(conn, dialect: str):
    """SQLite's foreign keys off while migrations run (SQLite's own procedure for a schema change:
    dropping the old copy of a rebuilt table would run its ON DELETE actions); `migrate` and
    `downgrade` check that a migration broke no reference."""
    if dialect != "sqlite":
        yield
        return
    raw = conn.connection.dbapi_connection  # (outside a transaction: the pragma is a no-op inside one)
    raw.execute("PRAGMA foreign_keys=OFF")
    try:
        yield
    finally:
        raw.execute("PRAGMA foreign_keys=ON")


def _broken_references(conn) -> int:
    """SQLite's rows whose foreign keys point nowhere (some may predate a migration: a row deleted by
    a tool that had foreign keys off)."""
    return len(conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall())
