"""spend_logs.user_incarnation: the incarnation of the user a request was admitted on

`/spend/logs` says `user_deleted` for a request of an account deleted since (or deleted and made
again under its id). It compared the request's start with the current account's `created_at`: two
gateways whose clocks differ, or an account made again in the same instant a request of the old one
started, read the old account's request as the new one's or the new one's as the old one's. Each row
now names the user row (migration 0015's incarnation) it was admitted on, and a row is the current
account's exactly when the incarnations match. Nullable, with no default: a gateway from before this
revision still running (a rolling upgrade) writes rows without it, as do the rows already here; those
keep the timestamp rule (ledger.of_deleted_user).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("spend_logs", sa.Column("user_incarnation", sa.String(32), nullable=True))


def downgrade() -> None:
    # (a plain DROP COLUMN, SQLite's own since 3.35: no copy of a table that may hold millions of rows)
    op.drop_column("spend_logs", "user_incarnation")
