"""users, api_keys, spend_logs, daily_spend, rate_windows

Revision ID: 0001
Revises:
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("user_id", sa.String(128), primary_key=True),
        sa.Column("max_budget", sa.Float()), sa.Column("spend", sa.Float(), nullable=False),
        sa.Column("reserved", sa.Float(), nullable=False), sa.Column("budget_duration", sa.String(16)),
        sa.Column("budget_reset_at", TZ), sa.Column("models", sa.JSON()),
        sa.Column("metadata", sa.JSON(), nullable=False), sa.Column("password_hash", sa.String(256)),
        sa.Column("created_at", TZ, nullable=False))
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("token_hash", sa.String(64), nullable=False), sa.Column("key_name", sa.String(32), nullable=False),
        sa.Column("key_alias", sa.String(128)),
        sa.Column("user_id", sa.String(128), sa.ForeignKey("users.user_id", ondelete="SET NULL")),
        sa.Column("models", sa.JSON()), sa.Column("max_budget", sa.Float()),
        sa.Column("spend", sa.Float(), nullable=False), sa.Column("reserved", sa.Float(), nullable=False),
        sa.Column("budget_duration", sa.String(16)), sa.Column("budget_reset_at", TZ),
        sa.Column("rpm_limit", sa.Integer()), sa.Column("tpm_limit", sa.Integer()),
        sa.Column("max_parallel_requests", sa.Integer()), sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("expires_at", TZ), sa.Column("blocked", sa.Boolean(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False), sa.Column("created_at", TZ, nullable=False))
    op.create_index("ix_api_keys_token_hash", "api_keys", ["token_hash"], unique=True)
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"])
    op.create_table(
        "spend_logs",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False, unique=True),
        sa.Column("key_id", sa.Integer()), sa.Column("user_id", sa.String(128)),
        sa.Column("model", sa.String(128), nullable=False), sa.Column("backend", sa.String(256)),
        sa.Column("route", sa.String(64), nullable=False), sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False), sa.Column("cost", sa.Float(), nullable=False),
        sa.Column("started_at", TZ, nullable=False), sa.Column("ended_at", TZ, nullable=False))
    op.create_index("ix_spend_logs_key_started", "spend_logs", ["key_id", "started_at"])
    op.create_index("ix_spend_logs_user_started", "spend_logs", ["user_id", "started_at"])
    op.create_index("ix_spend_logs_started", "spend_logs", ["started_at"])
    op.create_table(
        "daily_spend",
        sa.Column("day", sa.Date(), primary_key=True), sa.Column("key_id", sa.Integer(), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True), sa.Column("user_id", sa.String(128)),
        sa.Column("requests", sa.Integer(), nullable=False), sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False), sa.Column("cost", sa.Float(), nullable=False))
    op.create_table(
        "rate_windows",
        sa.Column("key_id", sa.Integer(), primary_key=True), sa.Column("window", sa.BigInteger(), primary_key=True),
        sa.Column("requests", sa.Integer(), nullable=False), sa.Column("tokens", sa.BigInteger(), nullable=False))


def downgrade() -> None:
    for table in ("rate_windows", "daily_spend", "spend_logs", "api_keys", "users"):
        op.drop_table(table)
