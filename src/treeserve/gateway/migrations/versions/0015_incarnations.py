"""users.incarnation, teams.incarnation and the holdings' copies: a user or team made again under a
deleted one's id is another row

A request's reservation and holding name the user and team rows it reserved on by id and
incarnation; a /team/delete or /user/delete, then a /team/new or /user/new with the same id, before
it settles would otherwise have its settlement (or a sweep) take its hold off the new row (its
`reserved` below 0) and put its spend there. Rows there already get a random incarnation each, and
the holdings in flight the one of the row they reserved on. The column's server default draws one
too, so that a gateway from before this revision still running (a rolling upgrade) can make users and
teams; the holdings it writes have none, and are settled and swept by id as before.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TABLES = (("users", "user_id", "user_incarnation"), ("teams", "team_id", "team_incarnation"))


def _random_hex() -> str:
    """32 random hex digits, drawn anew for each row an UPDATE or INSERT writes."""
    if op.get_bind().dialect.name == "sqlite":
        return "(lower(hex(randomblob(16))))"
    return "md5(random()::text || clock_timestamp()::text)"


def upgrade() -> None:
    for table, id_column, held in TABLES:
        op.add_column(table, sa.Column("incarnation", sa.String(32), nullable=True))
        op.execute(f"UPDATE {table} SET incarnation = {_random_hex()}")
        with op.batch_alter_table(table) as batch:
            batch.alter_column("incarnation", existing_type=sa.String(32), nullable=False,
                               server_default=sa.text(_random_hex()))
        op.add_column("holdings", sa.Column(held, sa.String(32), nullable=True))
        op.execute(f"UPDATE holdings SET {held} = (SELECT incarnation FROM {table} "
                   f"WHERE {table}.{id_column} = holdings.{id_column}) WHERE {id_column} IS NOT NULL")


def downgrade() -> None:
    for table, _, held in TABLES:
        with op.batch_alter_table("holdings") as batch:
            batch.drop_column(held)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("incarnation")
