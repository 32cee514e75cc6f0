"""teams, team_members, api_keys.team_id and holdings.team_id: LiteLLM's teams

A team's keys are held to its models and share its budget; a holding names the team its request
reserved on, so that a sweep after a gateway process died gives the team's reservation back too.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("team_id", sa.String(128), primary_key=True),
        sa.Column("team_alias", sa.String(128), nullable=True),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("max_budget", sa.Float(), nullable=True),
        sa.Column("spend", sa.Float(), nullable=False),
        sa.Column("reserved", sa.Float(), nullable=False),
        sa.Column("budget_duration", sa.String(16), nullable=True),
        sa.Column("budget_reset_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("blocked", sa.Boolean(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "team_members",
        sa.Column("team_id", sa.String(128), sa.ForeignKey("teams.team_id", ondelete="CASCADE"), primary_key=True),
        sa.Column("user_id", sa.String(128), sa.ForeignKey("users.user_id", ondelete="CASCADE"), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_team_members_user_id", "team_members", ["user_id"])
    # (a plain ADD COLUMN, its REFERENCES inline: a batch would rebuild SQLite's api_keys without its
    # AUTOINCREMENT, revision 0008's, and run the ON DELETE actions of the tables that point at it)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE api_keys ADD COLUMN team_id VARCHAR(128) REFERENCES teams (team_id)")
    else:
        op.add_column("api_keys", sa.Column("team_id", sa.String(128), nullable=True))
        op.create_foreign_key("api_keys_team_id_fkey", "api_keys", "teams", ["team_id"], ["team_id"])
    op.create_index("ix_api_keys_team_id", "api_keys", ["team_id"])
    op.add_column("holdings", sa.Column("team_id", sa.String(128), nullable=True))


def downgrade() -> None:
    op.drop_column("holdings", "team_id")
    op.drop_index("ix_api_keys_team_id", table_name="api_keys")
    if op.get_bind().dialect.name == "sqlite":  # (migrations run with SQLite's foreign keys off: no cascades)
        with op.batch_alter_table("api_keys", table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.drop_column("team_id")
    else:
        op.drop_constraint("api_keys_team_id_fkey", "api_keys", type_="foreignkey")
        op.drop_column("api_keys", "team_id")
    op.drop_index("ix_team_members_user_id", table_name="team_members")
    op.drop_table("team_members")
    op.drop_table("teams")
