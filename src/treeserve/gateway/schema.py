"""The gateway's tables (SQLAlchemy 2 declarative). Changes go through an Alembic migration in
`migrations/versions/`; `tests/test_gateway_store.py` checks that the migrations build this schema."""
from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import (JSON, BigInteger, Boolean, Date, DateTime, Float, ForeignKey, Index, Integer, LargeBinary,
                        String, Text, false, text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Dollars are shown to this many decimals: running sums of floats carry rounding leftovers (a key's
# reserved amount read 2.8e-17 with nothing in flight, a spend 0.30000000000000004)
MONEY_DECIMALS = 12


class Base(DeclarativeBase):
    pass


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def new_incarnation() -> str:
    """A fresh `incarnation` for a user or team row (see `User.incarnation`)."""
    return uuid.uuid4().hex


def aware(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite hands datetimes back without their zone; every one stored here is UTC."""
    return value.replace(tzinfo=dt.timezone.utc) if value is not None and value.tzinfo is None else value


def money(amount: float | None) -> float | None:
    """A sum of dollars as shown: rounded to MONEY_DECIMALS, and never -0.0."""
    return None if amount is None else round(amount, MONEY_DECIMALS) + 0.0


def iso(value: dt.datetime | None) -> str | None:
    return aware(value).isoformat() if value is not None else None


class User(Base):
    __tablename__ = "users"
    user_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    max_budget: Mapped[float | None] = mapped_column(Float)
    spend: Mapped[float] = mapped_column(Float, default=0.0)
    reserved: Mapped[float] = mapped_column(Float, default=0.0)  # worst cases of requests in flight
    budget_duration: Mapped[str | None] = mapped_column(String(16))
    budget_reset_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    models: Mapped[list | None] = mapped_column(JSON)
    extra: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    password_hash: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # this row's own identity, new each time the user is made: a user deleted and made again under its
    # user_id has another, so that a request admitted on the old one (its reservation and holding carry
    # it) settles on nothing rather than on the new user (migration 0015; teams have one alike)
    incarnation: Mapped[str] = mapped_column(String(32), default=new_incarnation)


class Team(Base):
    """LiteLLM's team: keys made for it are held to its models and share its budget (its spend is
    theirs together); members are users with a role in it."""
    __tablename__ = "teams"
    team_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    team_alias: Mapped[str | None] = mapped_column(String(128))
    models: Mapped[list | None] = mapped_column(JSON)
    max_budget: Mapped[float | None] = mapped_column(Float)
    spend: Mapped[float] = mapped_column(Float, default=0.0)
    reserved: Mapped[float] = mapped_column(Float, default=0.0)  # worst cases of its keys' requests in flight
    budget_duration: Mapped[str | None] = mapped_column(String(16))
    budget_reset_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    blocked: Mapped[bool] = mapped_column(Boolean, default=False)
    extra: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    incarnation: Mapped[str] = mapped_column(String(32), default=new_incarnation)  # (as a user's)


def user_row(user_id: str, incarnation: str | None):
    """The user `user_id` while it is the row `incarnation` names (not one made again since); with no
    incarnation (a holding a gateway from before migration 0015 wrote), the user of that id."""
    where = User.user_id == user_id
    return where if incarnation is None else where & (User.incarnation == incarnation)


def team_row(team_id: str, incarnation: str | None):
    """As `user_row`, for a team."""
    where = Team.team_id == team_id
    return where if incarnation is None else where & (Team.incarnation == incarnation)


class TeamMember(Base):
    __tablename__ = "team_members"
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.team_id", ondelete="CASCADE"), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.user_id", ondelete="CASCADE"), primary_key=True,
                                         index=True)
    role: Mapped[str] = mapped_column(String(16))  # "admin" or "user" (LiteLLM's)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    # SQLite's AUTOINCREMENT: never a deleted key's id again (spend logs, daily spend and rate windows
    # keep a key's id after it is deleted; a new key with that id would inherit them)
    # A user has at most one web chat key (the database says so: two first sign-ins at once, or an
    # admin's key, can never make a second one the chat picks up)
    __table_args__ = (Index("ix_api_keys_web_chat_user", "user_id", unique=True, sqlite_where=text("web_chat"),
                            postgresql_where=text("web_chat")),
                      {"sqlite_autoincrement": True})
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    key_name: Mapped[str] = mapped_column(String(32))  # "sk-...abcd": enough to recognise, useless to use
    # unique (LiteLLM's rule), held by the database's index: two creates at once cannot both take one
    key_alias: Mapped[str | None] = mapped_column(String(128), unique=True, index=True)
    # the key the web chat bills a user's messages to (made by the chat, never by the admin API)
    web_chat: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    user_id: Mapped[str | None] = mapped_column(ForeignKey("users.user_id", ondelete="SET NULL"), index=True)
    # a team's keys are deleted with it (LiteLLM's /team/delete, gateway/teams.py); the reference (no
    # ON DELETE action) refuses any write that would leave a key outliving the team that holds it
    team_id: Mapped[str | None] = mapped_column(ForeignKey("teams.team_id"), index=True)
    models: Mapped[list | None] = mapped_column(JSON)
    max_budget: Mapped[float | None] = mapped_column(Float)
    soft_budget: Mapped[float | None] = mapped_column(Float)  # LiteLLM's: crossing it is logged, nothing refused
    spend: Mapped[float] = mapped_column(Float, default=0.0)
    reserved: Mapped[float] = mapped_column(Float, default=0.0)
    budget_duration: Mapped[str | None] = mapped_column(String(16))
    budget_reset_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer)
    in_flight: Mapped[int] = mapped_column(Integer, default=0)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    blocked: Mapped[bool] = mapped_column(Boolean, default=False)
    extra: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SpendLog(Base):
    """One row per request that reached a backend (or was cut on the way), with what it cost."""
    __tablename__ = "spend_logs"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    key_id: Mapped[int | None] = mapped_column(Integer)
    user_id: Mapped[str | None] = mapped_column(String(128))
    # the incarnation of the user row it was admitted on (User.incarnation): whether that account is the
    # one of its id now, exactly (ledger.of_deleted_user). None: no user, or written before migration 0016
    user_incarnation: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(128))
    backend: Mapped[str | None] = mapped_column(String(256))
    route: Mapped[str] = mapped_column(String(64))
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str] = mapped_column(String(16))  # success, error (nothing served), cut (a stream broke)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cost: Mapped[float] = mapped_column(Float, default=0.0)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    __table_args__ = (Index("ix_spend_logs_key_started", "key_id", "started_at"),
                      Index("ix_spend_logs_user_started", "user_id", "started_at"),
                      Index("ix_spend_logs_started", "started_at"))


class DailySpend(Base):
    """Spend per day, key and model: what dashboards and budgets read without scanning the logs."""
    __tablename__ = "daily_spend"
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    key_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    user_id: Mapped[str | None] = mapped_column(String(128))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost: Mapped[float] = mapped_column(Float, default=0.0)


class RateWindow(Base):
    """Requests and tokens of one key in one minute: counted in the database, so every gateway
    process sharing it enforces the same limits."""
    __tablename__ = "rate_windows"
    key_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # minutes since the epoch
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class Holding(Base):
    """A request admitted and not yet settled: the worst case it reserved, whether it holds a
    parallel slot, and which gateway process admitted it, so that the holdings of a process that
    died are given back (`Instances.sweep`) instead of blocking its keys for good."""
    __tablename__ = "holdings"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(32), index=True)
    key_id: Mapped[int] = mapped_column(Integer)
    user_id: Mapped[str | None] = mapped_column(String(128))
    team_id: Mapped[str | None] = mapped_column(String(128))
    # the incarnations of the user and team it reserved on: a sweep gives back to those rows only
    user_incarnation: Mapped[str | None] = mapped_column(String(32))
    team_incarnation: Mapped[str | None] = mapped_column(String(32))
    worst_cost: Mapped[float] = mapped_column(Float)  # (its real cost once answered)
    parallel: Mapped[bool] = mapped_column(Boolean)
    answered: Mapped[bool] = mapped_column(Boolean, default=False)  # (its cost is spent, the settlement to come)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class Instance(Base):
    """A running gateway process and when it last said so (every few seconds)."""
    __tablename__ = "gateway_instances"
    instance_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    seen_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class ChatSession(Base):
    """A signed-in browser: the cookie's hash (the cookie itself is never stored) and the token its
    page must echo in a header on every change (CSRF)."""
    __tablename__ = "chat_sessions"
    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.user_id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class Conversation(Base):
    """A chat of one user; its id is random (it is the page's URL) and its settings are the ones the
    page sends with each message."""
    __tablename__ = "conversations"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.user_id", ondelete="CASCADE"))
    title: Mapped[str] = mapped_column(String(200))
    settings: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    __table_args__ = (Index("ix_conversations_user_updated", "user_id", "updated_at"),)


class ChatMessage(Base):
    """One message; `details` holds what a mode adds (a search's candidates, a tool's call and result,
    whether the answer was stopped)."""
    __tablename__ = "chat_messages"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(String(128))
    mode: Mapped[str] = mapped_column(String(16), default="chat")
    settings: Mapped[dict] = mapped_column(JSON, default=dict)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class StoredResponse(Base):
    """A Responses API response kept for `previous_response_id`, retrieve and delete: readable only
    with the key that made it (`api_key_id`; NULL for the master key). `history` is the chat messages
    a following response continues from."""
    __tablename__ = "stored_responses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    response: Mapped[dict] = mapped_column(JSON)
    history: Mapped[list] = mapped_column(JSON)
    input_items: Mapped[list] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class ApiConversation(Base):
    """A Conversations API conversation (`/v1/conversations`; the web chat's are `conversations`):
    readable only with the key that made it (`api_key_id`; NULL for the master key). Its items are
    `api_conversation_items` rows."""
    __tablename__ = "api_conversations"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    meta: Mapped[dict] = mapped_column("metadata", JSON)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class ApiConversationItem(Base):
    """An item of a conversation, as OpenAI shows it; `position` orders a conversation's items (the
    order they were added in)."""
    __tablename__ = "api_conversation_items"
    __table_args__ = (Index("ix_api_conversation_items_conversation_item", "conversation_id", "item_id", unique=True),)
    position: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("api_conversations.id", ondelete="CASCADE"))
    item_id: Mapped[str] = mapped_column(String(64))
    item: Mapped[dict] = mapped_column(JSON)


class StoredFile(Base):
    """A file uploaded for the Batch API (purpose `batch`), or a batch's output or error file
    (`batch_output`); readable only with the key that owns it (NULL: the master key)."""
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class Batch(Base):
    """A batch of requests read from an uploaded file. A gateway process runs it while it holds its
    lease (`lease_owner` until `lease_expires`): a process that died leaves it to another, or to
    itself restarted, which goes on from the lines that have no answer."""
    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer)
    extra: Mapped[dict | None] = mapped_column("metadata", JSON)
    errors: Mapped[list | None] = mapped_column(JSON)  # (a batch whose file failed validation: its lines' errors)
    model: Mapped[str | None] = mapped_column(String(128))  # (the model its lines name; null when they name several)
    lease_owner: Mapped[str | None] = mapped_column(String(32))
    lease_expires: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class BatchLine(Base):
    """One request of a batch: pending, running, done (its answer in `response`, written in the same
    transaction as its spend row: gateway/settlement.py) or failed (`error`: refused by the gateway,
    or no backend could answer)."""
    __tablename__ = "batch_lines"
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(256))
    url: Mapped[str] = mapped_column(String(64))  # its route (a batch may mix them: treeserve's extension)
    body: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    status_code: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[dict | None] = mapped_column(JSON)
    error: Mapped[dict | None] = mapped_column(JSON)
    request_id: Mapped[str | None] = mapped_column(String(96))
    # an answered line's tokens (billed, with its answer's cached and reasoning ones): the batch's usage
    input_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    reasoning_tokens: Mapped[int | None] = mapped_column(Integer)
    # (a batch's pending lines in line order: batches.Batches.pending; migration 0006)
    __table_args__ = (Index("ix_batch_lines_batch_status_line", "batch_id", "status", "line"),)
