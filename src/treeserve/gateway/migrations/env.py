"""Alembic environment: the gateway passes its open connection in `config.attributes["connection"]`;
`alembic -x url=...` (run from this folder's parent with `-c`) works for hand-made revisions too. Take a
database back with `treeserve gateway db downgrade REV` (Database.downgrade): on SQLite it turns foreign keys
off first, as upgrades do; a downgrade on a connection of the gateway's engine (which turns them on) would
cascade the drop of every table a revision rebuilds to its children."""
from alembic import context
from sqlalchemy import create_engine

from treeserve.gateway.schema import Base

config = context.config


def run_with(connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_with(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    with create_engine(url).connect() as conn:
        run_with(conn)
