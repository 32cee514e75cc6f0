"""files, batches, batch_lines: the Files and Batch APIs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("api_key_id", sa.Integer(), sa.ForeignKey("api_keys.id", ondelete="CASCADE")),
        sa.Column("purpose", sa.String(32), nullable=False), sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False), sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", TZ, nullable=False))
    op.create_index("ix_files_api_key_id", "files", ["api_key_id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("api_key_id", sa.Integer(), sa.ForeignKey("api_keys.id", ondelete="CASCADE")),
        sa.Column("endpoint", sa.String(64), nullable=False), sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False), sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_file_id", sa.String(64)), sa.Column("error_file_id", sa.String(64)),
        sa.Column("total", sa.Integer(), nullable=False), sa.Column("metadata", sa.JSON()),
        sa.Column("lease_owner", sa.String(32)), sa.Column("lease_expires", TZ),
        sa.Column("created_at", TZ, nullable=False), sa.Column("in_progress_at", TZ), sa.Column("finalizing_at", TZ),
        sa.Column("completed_at", TZ), sa.Column("cancelling_at", TZ), sa.Column("cancelled_at", TZ),
        sa.Column("expires_at", TZ, nullable=False))
    op.create_index("ix_batches_api_key_id", "batches", ["api_key_id"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("line", sa.Integer(), primary_key=True), sa.Column("custom_id", sa.String(256), nullable=False),
        sa.Column("url", sa.String(64), nullable=False), sa.Column("body", sa.JSON(), nullable=False), sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_code", sa.Integer()), sa.Column("response", sa.JSON()), sa.Column("error", sa.JSON()),
        sa.Column("request_id", sa.String(96)))
    op.create_index("ix_batch_lines_batch_status", "batch_lines", ["batch_id", "status"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
