"""batches: errors and failed_at, for a batch whose input file fails validation

OpenAI creates a batch from any batch file it can read and, when the file's lines do not validate,
ends it `failed` with the lines' errors (`errors.data`: code, message, param, line). Before, the
gateway refused the create call with a 400 naming the first bad line.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("errors", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("failed_at")
        batch.drop_column("errors")
