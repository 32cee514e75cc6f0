"""holdings: answered, so a refusal can tell a budget spent from one held

A request's hold is cut to its real cost at its answer, and moved to `spend` by its settlement a
moment later. A budget refused in between was reached by money spent, not by worst cases of
requests in flight: `answered` marks those holds, and the refusal is a 400 (spent), not a 429
(held: try again).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("holdings") as batch:
        batch.add_column(sa.Column("answered", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("holdings") as batch:
        batch.drop_column("answered")
