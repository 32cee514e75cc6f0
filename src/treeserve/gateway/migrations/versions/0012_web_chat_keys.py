"""api_keys: web_chat, the flag that marks a user's web chat key (at most one per user)

The chat found a user's key by its alias `chat:<user>`, so a key an admin made with that alias (and
the user's id) was picked up as the user's chat key. The chat now finds its key by this flag, which
only the chat sets. A user's existing chat key is the oldest of their keys that the chat made (alias
`chat:<user>` and metadata purpose "web chat"); any other such key stays an ordinary key.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # (a plain ADD COLUMN: a batch would rebuild SQLite's table without its AUTOINCREMENT, revision 0008's)
    op.add_column("api_keys", sa.Column("web_chat", sa.Boolean(), nullable=False, server_default=sa.false()))
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, user_id, key_alias, metadata FROM api_keys "
                                "WHERE key_alias LIKE 'chat:%' AND user_id IS NOT NULL ORDER BY id")).all()
    marked = set()
    for key_id, user_id, alias, metadata in rows:
        metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
        made_by_chat = isinstance(metadata, dict) and metadata.get("purpose") == "web chat"  # (null, a list: no)
        if alias == f"chat:{user_id}" and made_by_chat and user_id not in marked:
            marked.add(user_id)
            conn.execute(sa.text("UPDATE api_keys SET web_chat = :yes WHERE id = :id"), {"yes": True, "id": key_id})
    op.create_index("ix_api_keys_web_chat_user", "api_keys", ["user_id"], unique=True,
                    sqlite_where=sa.text("web_chat"), postgresql_where=sa.text("web_chat"))


def downgrade() -> None:
    op.drop_index("ix_api_keys_web_chat_user", table_name="api_keys")
    with op.batch_alter_table("api_keys", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("web_chat")
