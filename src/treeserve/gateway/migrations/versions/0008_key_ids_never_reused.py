"""api_keys: ids never reused on SQLite (AUTOINCREMENT)

SQLite gives a new row the highest id in the table plus one, so a key created after the newest key
was deleted took its id, and with it the deleted key's spend logs, daily spend and this minute's
rate window (which keep a key's id after it is gone): its first request could be refused for the
other key's rpm_limit. PostgreSQL's sequences never go back; nothing changes there.

The table is rebuilt with AUTOINCREMENT (Database.migrate turns SQLite's foreign keys off around a
migration, so rebuilding it does not cascade to files, batches and responses), and its sequence
starts past every key id any table has seen.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SEEN = ("SELECT max(id) FROM (SELECT max(id) AS id FROM api_keys UNION ALL SELECT max(key_id) FROM spend_logs "
        "UNION ALL SELECT max(key_id) FROM daily_spend UNION ALL SELECT max(key_id) FROM rate_windows "
        "UNION ALL SELECT max(key_id) FROM holdings)")


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("api_keys", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
        pass
    op.execute("DELETE FROM sqlite_sequence WHERE name = 'api_keys'")
    op.execute(f"INSERT INTO sqlite_sequence (name, seq) SELECT 'api_keys', coalesce(({SEEN}), 0)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("api_keys", recreate="always", table_kwargs={"sqlite_autoincrement": False}):
        pass
