"""stored_responses: the Responses API's stored responses, per key

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("api_key_id", sa.Integer(), sa.ForeignKey("api_keys.id", ondelete="CASCADE")),
        sa.Column("response", sa.JSON(), nullable=False), sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False))
    op.create_index("ix_stored_responses_api_key_id", "stored_responses", ["api_key_id"])


def downgrade() -> None:
    op.drop_table("stored_responses")
