"""The web chat's rows: sign-in sessions, conversations and messages, in the gateway's database.

Every read and change of a conversation names its user, and a conversation of another user is
answered exactly as one that does not exist (404), so ids cannot be probed. Calls are blocking:
the routes run them in worker threads."""
from __future__ import annotations

import datetime as dt
import secrets

from sqlalchemy import delete, func, insert, select, update

from treeserve.gateway import keys as keylib
from treeserve.gateway.accounts import CHAT_ALIAS_PREFIX, Accounts
from treeserve.gateway.database import Database
from treeserve.gateway.errors import (ChatKeyBlocked, ConversationNotFound, MessageNotFound, NothingToAnswer,
                                      QuestionReplaced, UserNotFound)
from treeserve.gateway.ledger import of_user_now
from treeserve.gateway.passwords import hash_password, needs_rehash, verify_password
from treeserve.gateway.schema import (ApiKey, ChatMessage, ChatSession, Conversation, SpendLog, User, aware, iso,
                                      money, utcnow)

SESSION_LIFETIME = dt.timedelta(days=7)
CHAT_KEY_ALIAS = CHAT_ALIAS_PREFIX + "{user_id}"  # a label: the chat finds its key by ApiKey.web_chat
TITLE_LENGTH = 200


class ChatStore:
    def __init__(self, db: Database, accounts: Accounts):
        self.db, self.accounts = db, accounts

    # ---- signing in --------------------------------------------------------------------------
    def check_password(self, user_id: str, password: str) -> bool:
        with self.db.session() as conn:
            stored = conn.scalar(select(User.password_hash).where(User.user_id == user_id))
        if not verify_password(stored, password):
            return False
        if needs_rehash(stored):  # the hasher's parameters went up since: keep the hash current
            self.accounts.set_password_hash(user_id, hash_password(password))
        return True

    def set_password(self, user_id: str, password: str) -> None:
        password_hash = hash_password(password)
        with self.db.transaction() as conn:
            if conn.get(User, user_id) is None:
                raise UserNotFound(user_id)
            conn.execute(update(User).where(User.user_id == user_id).values(password_hash=password_hash))
            conn.execute(delete(ChatSession).where(ChatSession.user_id == user_id))  # signed out everywhere

    def start_session(self, user_id: str) -> tuple[str, str]:
        """(the cookie's token, the page's CSRF token) of a new session."""
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        now = utcnow()
        with self.db.transaction() as conn:
            conn.execute(delete(ChatSession).where(ChatSession.expires_at < now))
            conn.execute(insert(ChatSession).values(token_hash=keylib.hash_key(token), user_id=user_id,
                                                    csrf_token=csrf, created_at=now,
                                                    expires_at=now + SESSION_LIFETIME))
        return token, csrf

    def session_user(self, token: str) -> tuple[str, str] | None:
        """(user_id, csrf token) of a live session, or None."""
        with self.db.session() as conn:
            row = conn.execute(select(ChatSession.user_id, ChatSession.csrf_token, ChatSession.expires_at)
                               .where(ChatSession.token_hash == keylib.hash_key(token))).first()
        if row is None or aware(row.expires_at) <= utcnow():
            return None
        return row.user_id, row.csrf_token

    def end_session(self, token: str) -> None:
        with self.db.transaction() as conn:
            conn.execute(delete(ChatSession).where(ChatSession.token_hash == keylib.hash_key(token)))

    def chat_key(self, user_id: str) -> keylib.KeyRecord:
        """The key the chat bills a user's messages to (made on first use; the user's budget and
        model list apply to it as to any key of theirs). It is found by its web_chat flag, which only
        the chat sets (an admin's key with any alias is never taken for it), and made in one
        transaction with the user's row locked, so two first sign-ins at once make one key (a unique
        index also allows one per user)."""
        alias = CHAT_KEY_ALIAS.format(user_id=user_id)
        with self.db.transaction() as conn:
            conn.execute(select(User.user_id).where(User.user_id == user_id).with_for_update())
            key_id = conn.scalar(select(ApiKey.id).where(ApiKey.user_id == user_id, ApiKey.web_chat))
            if key_id is None:
                # the admin API gives no key a `chat:` alias; a key made before it refused them may
                # hold this one: the chat key is then named by its display name
                taken = conn.scalar(select(ApiKey.id).where(ApiKey.key_alias == alias)) is not None
                token = keylib.new_key()  # never shown: the chat uses the key by its id
                key_id = conn.execute(insert(ApiKey).values(
                    token_hash=keylib.hash_key(token), key_name=keylib.display_name(token),
                    key_alias=None if taken else alias, user_id=user_id, spend=0.0, reserved=0.0, in_flight=0,
                    blocked=False, web_chat=True, extra={"purpose": "web chat"}, created_at=utcnow())
                    .returning(ApiKey.id)).scalar_one()
        record = self.accounts.key_record(key_id)
        if record is None:
            raise ChatKeyBlocked()
        return record

    # ---- conversations -----------------------------------------------------------------------
    def conversations(self, user_id: str) -> list[dict]:
        with self.db.session() as conn:
            rows = conn.scalars(select(Conversation).where(Conversation.user_id == user_id)
                                .order_by(Conversation.updated_at.desc())).all()
        return [_public_conversation(c) for c in rows]

    def create(self, user_id: str, title: str, settings: dict) -> dict:
        now = utcnow()
        conversation_id = secrets.token_hex(16)
        with self.db.transaction() as conn:
            conn.execute(insert(Conversation).values(id=conversation_id, user_id=user_id, title=_title(title),
                                                     settings=settings, created_at=now, updated_at=now))
        return self.get(user_id, conversation_id)

    def get(self, user_id: str, conversation_id: str) -> dict:
        with self.db.session() as conn:
            conversation = self._owned(conn, user_id, conversation_id)
            messages = conn.scalars(select(ChatMessage).where(ChatMessage.conversation_id == conversation_id)
                                    .order_by(ChatMessage.id)).all()
        return _public_conversation(conversation) | {"messages": [public_message(m) for m in messages]}

    def update(self, user_id: str, conversation_id: str, title: str | None = None,
               settings: dict | None = None) -> dict:
        values = {"updated_at": utcnow()}
        if title is not None:
            values["title"] = _title(title)
        if settings is not None:
            values["settings"] = settings
        with self.db.transaction() as conn:
            self._owned(conn, user_id, conversation_id)
            conn.execute(update(Conversation).where(Conversation.id == conversation_id).values(**values))
        return self.get(user_id, conversation_id)

    def delete(self, user_id: str, conversation_id: str) -> None:
        with self.db.transaction() as conn:
            self._owned(conn, user_id, conversation_id)
            conn.execute(delete(ChatMessage).where(ChatMessage.conversation_id == conversation_id))
            conn.execute(delete(Conversation).where(Conversation.id == conversation_id))

    def add_message(self, user_id: str, conversation_id: str, role: str, content: str, *, answers: int | None = None,
                    **fields) -> dict:
        """`answers`: the id of the question an answer answers; an answer whose question was edited or
        regenerated meanwhile (deleted) is not stored (QuestionReplaced). `fields`: model, mode,
        settings, prompt_tokens, completion_tokens, details."""
        with self.db.transaction() as conn:
            # locked: a delete committed between the check and the insert would fail the insert on the
            # foreign key (an IntegrityError, not ConversationNotFound); a delete now waits or has won
            self._owned(conn, user_id, conversation_id, lock=True)
            if answers is not None and conn.scalar(select(ChatMessage.id).where(
                    ChatMessage.id == answers, ChatMessage.conversation_id == conversation_id)) is None:
                raise QuestionReplaced()
            return _insert_message(conn, conversation_id, role, content, **fields)

    def restart_plan(self, user_id: str, conversation_id: str, message_id: int | None) -> tuple[dict, list[dict]]:
        """Where an Edit or a Regenerate from the user's message `message_id` (None: their last one) would
        start, changing nothing: (that message, the messages before it). The errors of `restart_at`."""
        with self.db.session() as conn:
            self._owned(conn, user_id, conversation_id)
            messages = conn.scalars(select(ChatMessage).where(ChatMessage.conversation_id == conversation_id)
                                    .order_by(ChatMessage.id)).all()
            question = messages[_restart_point(messages, message_id)]
            return public_message(question), [public_message(m) for m in messages if m.id < question.id]

    def restart_at(self, user_id: str, conversation_id: str, message_id: int | None, content: str | None,
                   **fields) -> tuple[dict, list[dict]]:
        """Edit (`content`) or Regenerate (`content` None: the same text) from the user's message
        `message_id` (None: their last one): it and every message after it are deleted and it is stored
        anew, under a new id, so that an answer to the old one still streaming is never stored.
        (the message as stored, the messages before it)"""
        with self.db.transaction() as conn:
            self._owned(conn, user_id, conversation_id, lock=True)
            messages = conn.scalars(select(ChatMessage).where(ChatMessage.conversation_id == conversation_id)
                                    .order_by(ChatMessage.id)).all()
            question = messages[_restart_point(messages, message_id)]
            history = [public_message(m) for m in messages if m.id < question.id]
            # added before the old ones go: its id is above theirs (SQLite reuses the highest id freed)
            stored = _insert_message(conn, conversation_id, "user", question.content if content is None else content,
                                     **fields)
            conn.execute(delete(ChatMessage).where(ChatMessage.conversation_id == conversation_id,
                                                   ChatMessage.id >= question.id, ChatMessage.id != stored["id"]))
            return stored, history

    def export_rows(self, user_id: str, conversation_id: str | None = None) -> list[dict]:
        """The user's conversations (or one), each with its messages, oldest first."""
        with self.db.session() as conn:
            if conversation_id is not None:
                conversations = [self._owned(conn, user_id, conversation_id)]
            else:
                conversations = conn.scalars(select(Conversation).where(Conversation.user_id == user_id)
                                             .order_by(Conversation.created_at)).all()
            ids = [c.id for c in conversations]
            messages = conn.scalars(select(ChatMessage).where(ChatMessage.conversation_id.in_(ids))
                                    .order_by(ChatMessage.id)).all() if ids else []
        by_conversation: dict[str, list[dict]] = {i: [] for i in ids}
        for message in messages:
            by_conversation[message.conversation_id].append(public_message(message))
        return [_public_conversation(c) | {"messages": by_conversation[c.id]} for c in conversations]

    def usage(self, user_id: str) -> dict:
        """What the user has spent through the gateway (the chat and any key of theirs): the requests
        since it was made (a user deleted and made again under its id has none of the old one's)."""
        with self.db.session() as conn:
            user = conn.get(User, user_id)
            spend, budget = (user.spend or 0.0, user.max_budget) if user is not None else (0.0, None)
            own = of_user_now(user) if user is not None else SpendLog.user_id == user_id
            row = conn.execute(select(func.count(), func.coalesce(func.sum(SpendLog.prompt_tokens), 0),
                                      func.coalesce(func.sum(SpendLog.completion_tokens), 0)).where(own)).one()
        return {"requests": row[0], "prompt_tokens": int(row[1]), "completion_tokens": int(row[2]),
                "cost": money(spend), "max_budget": budget}

    @staticmethod
    def _owned(conn, user_id: str, conversation_id: str, lock: bool = False) -> Conversation:
        """The user's conversation (its row locked until the transaction ends where `lock`: PostgreSQL's
        FOR UPDATE; SQLite's writers hold the database's lock already), or ConversationNotFound."""
        conversation = conn.get(Conversation, conversation_id, with_for_update=lock or None) \
            if isinstance(conversation_id, str) else None
        if conversation is None or conversation.user_id != user_id:
            raise ConversationNotFound()
        return conversation


def _insert_message(conn, conversation_id: str, role: str, content: str, *, model: str | None = None,
                    mode: str = "chat", settings: dict | None = None, prompt_tokens: int = 0,
                    completion_tokens: int = 0, details: dict | None = None) -> dict:
    """A message added to a conversation whose row the caller holds locked."""
    now = utcnow()
    content = content.replace("\x00", "\ufffd")  # a model may write one; PostgreSQL text cannot hold it
    message_id = conn.execute(insert(ChatMessage).values(
        conversation_id=conversation_id, role=role, content=content, model=model, mode=mode,
        settings=settings or {}, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        details=details or {}, created_at=now).returning(ChatMessage.id)).scalar_one()
    conn.execute(update(Conversation).where(Conversation.id == conversation_id).values(updated_at=now))
    return public_message(conn.get(ChatMessage, message_id))


def _restart_point(messages: list[ChatMessage], message_id: int | None) -> int:
    """Where Edit or Regenerate starts: the position of the user's message `message_id`, or of their last."""
    if message_id is None:
        mine = [i for i, m in enumerate(messages) if m.role == "user"]
        if not mine:
            raise NothingToAnswer("conversation: it has no message of yours to answer again", "conversation")
        return mine[-1]
    at = next((i for i, m in enumerate(messages) if m.id == message_id), None)
    if at is None:
        raise MessageNotFound(message_id)
    if messages[at].role != "user":
        raise NothingToAnswer(f"message_id: message {message_id} is an answer; only your own messages can be "
                              "edited", "message_id")
    return at


def _title(title: str) -> str:
    title = " ".join((title or "").split())[:TITLE_LENGTH]
    return title or "New chat"


def _public_conversation(conversation: Conversation) -> dict:
    return {"id": conversation.id, "title": conversation.title, "settings": conversation.settings or {},
            "created_at": iso(conversation.created_at), "updated_at": iso(conversation.updated_at)}


def public_message(message: ChatMessage) -> dict:
    return {"id": message.id, "role": message.role, "content": message.content, "model": message.model,
            "mode": message.mode, "settings": message.settings or {}, "prompt_tokens": message.prompt_tokens,
            "completion_tokens": message.completion_tokens, "details": message.details or {},
            "created_at": iso(message.created_at)}
