"""api_keys: soft_budget (LiteLLM's), a spend past which the gateway warns and refuses nothing

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("soft_budget", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("soft_budget")
