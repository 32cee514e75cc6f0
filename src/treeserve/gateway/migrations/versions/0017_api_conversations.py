"""api_conversations, api_conversation_items: the Conversations API's conversations, per key

(`conversations` is the web chat's.)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_conversations",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("api_key_id", sa.Integer(), sa.ForeignKey("api_keys.id", ondelete="CASCADE")),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False))
    op.create_index("ix_api_conversations_api_key_id", "api_conversations", ["api_key_id"])
    op.create_table(
        "api_conversation_items",
        sa.Column("position", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("conversation_id", sa.String(64), sa.ForeignKey("api_conversations.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("item_id", sa.String(64), nullable=False),
        sa.Column("item", sa.JSON(), nullable=False))
    op.create_index("ix_api_conversation_items_conversation_item", "api_conversation_items", ["conversation_id", "item_id"],
                    unique=True)


def downgrade() -> None:
    op.drop_table("api_conversation_items")
    op.drop_table("api_conversations")
