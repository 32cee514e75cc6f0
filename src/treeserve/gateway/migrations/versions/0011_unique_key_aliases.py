"""api_keys: key_alias unique in the database (a unique index), not only checked before a write

The gateway read whether an alias was free and then wrote it, so two /key/generate calls at once
on PostgreSQL could both take one alias (each read before the other wrote). Aliases already held by
several keys keep it on the oldest; the others get " #<id>" appended (logged), so the index can be
built.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30
"""
import logging

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None
ALIAS_LENGTH = 128


def upgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, key_alias FROM api_keys WHERE key_alias IS NOT NULL ORDER BY id")).all()
    taken = {alias for _, alias in rows}
    held = set()
    for key_id, alias in rows:
        if alias not in held:
            held.add(alias)
            continue
        renamed, tries = alias, 0
        while renamed in taken:  # (" #<id>" is free but for an alias someone chose to look like one)
            suffix = f" #{key_id}" + (f".{tries}" if tries else "")
            renamed, tries = alias[:ALIAS_LENGTH - len(suffix)] + suffix, tries + 1
        taken.add(renamed)
        logging.getLogger("alembic").warning("key %d shared its alias %r with an older key: it is now %r",
                                             key_id, alias, renamed)
        conn.execute(sa.text("UPDATE api_keys SET key_alias = :alias WHERE id = :id"), {"alias": renamed, "id": key_id})
    op.create_index("ix_api_keys_key_alias", "api_keys", ["key_alias"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_api_keys_key_alias", table_name="api_keys")
