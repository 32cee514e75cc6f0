"""holdings and gateway_instances: what each gateway process has reserved, and whether it lives

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "holdings",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("instance_id", sa.String(32), nullable=False), sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.String(128)), sa.Column("worst_cost", sa.Float(), nullable=False),
        sa.Column("parallel", sa.Boolean(), nullable=False), sa.Column("created_at", TZ, nullable=False))
    op.create_index("ix_holdings_instance_id", "holdings", ["instance_id"])
    op.create_table(
        "gateway_instances",
        sa.Column("instance_id", sa.String(32), primary_key=True), sa.Column("seen_at", TZ, nullable=False))


def downgrade() -> None:
    op.drop_table("gateway_instances")
    op.drop_table("holdings")
