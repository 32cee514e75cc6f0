"""batches: model, usage and expired_at, as OpenAI's batch object has them

OpenAI's batch names its `model` and sums its answered requests' `usage` (input_tokens and their
cached_tokens, output_tokens and their reasoning_tokens, total_tokens); the gateway answered null
for both. Each answered line now keeps its tokens (batch_lines: input_tokens, cached_tokens,
output_tokens, reasoning_tokens, written with its spend row), which the batch object sums; a line
answered before this revision gets its billed tokens from its spend row (its cached and reasoning
tokens count 0). An expired batch kept its expiry in `completed_at`; it has its own column now.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TOKENS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")


def upgrade() -> None:
    # (plain ADD COLUMNs: a batch would rebuild SQLite's batches, whose lines cascade from it)
    op.add_column("batches", sa.Column("model", sa.String(128), nullable=True))
    op.add_column("batches", sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))
    for name in TOKENS:
        op.add_column("batch_lines", sa.Column(name, sa.Integer(), nullable=True))
    conn = op.get_bind()
    conn.execute(sa.text("UPDATE batches SET expired_at = completed_at, completed_at = NULL WHERE status = 'expired'"))
    spent = "(SELECT s.{} FROM spend_logs s WHERE s.request_id = batch_lines.request_id)"
    conn.execute(sa.text(f"UPDATE batch_lines SET input_tokens = {spent.format('prompt_tokens')}, "
                         f"output_tokens = {spent.format('completion_tokens')} WHERE status = 'done'"))
    conn.execute(sa.text("UPDATE batches SET model = (SELECT MIN(s.model) FROM batch_lines l JOIN spend_logs s "
                         "ON s.request_id = l.request_id WHERE l.batch_id = batches.id HAVING MIN(s.model) = "
                         "MAX(s.model))"))


def downgrade() -> None:
    # (plain DROP COLUMNs, SQLite's own since 3.35: a batch would rebuild batches, and dropping the old
    # table would delete every line through their ON DELETE CASCADE)
    op.execute("UPDATE batches SET completed_at = expired_at WHERE status = 'expired'")
    for name in reversed(TOKENS):
        op.drop_column("batch_lines", name)
    op.drop_column("batches", "expired_at")
    op.drop_column("batches", "model")
