"""OpenAI's Conversations API (`/v1/conversations`): a conversation is a list of items (messages,
function calls and their outputs, as the Responses API takes them) a response can continue
(`conversation`: its input and output are appended). The request bodies, and items as OpenAI shows
them: typed, with an id and a status; each is checked as the Responses API reads its input, so an
item no response could read is a 400 naming it (`items[2].role`)."""
from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from treeserve.errors import ParamError
from treeserve.wire.errors import APIError
from treeserve.wire.metadata import Metadata
from treeserve.wire.responses import input_item, input_messages, new_id

MAX_ITEMS_PER_REQUEST = 20  # (OpenAI's: "You may add up to 20 items at a time")
MAX_ITEM_ID_CHARS = 64
# (treeserve's: OpenAI documents no bound; without one a client could grow a conversation, 20 items at a
# time, until the store held all memory, and every response continuing it reads it whole)
MAX_ITEMS_PER_CONVERSATION = 1000


class ConversationFull(Exception):
    """An append refused: the conversation holds `held` items, and `adding` more would pass its bound."""

    def __init__(self, held: int, adding: int):
        super().__init__(f"holds {held} items, {adding} more would pass {MAX_ITEMS_PER_CONVERSATION}")
        self.held, self.adding = held, adding


class ItemIdTaken(Exception):
    """An append refused: the conversation already holds an item with `item_id` (added meanwhile)."""

    def __init__(self, item_id: str):
        super().__init__(f"the conversation already holds an item with id {item_id!r}")
        self.item_id = item_id


def check_append(held: int, taken: list[str], adding: int, limit: int | None) -> None:
    """A store's check, in the transaction that appends: ConversationFull past `limit` (None: unbounded),
    ItemIdTaken for the first id of the items (`taken`) that the conversation already holds."""
    if taken:
        raise ItemIdTaken(taken[0])
    if limit is not None and held + adding > limit:
        raise ConversationFull(held, adding)


class ConversationCreateRequest(BaseModel):
    """POST /v1/conversations."""
    model_config = ConfigDict(extra="forbid", strict=True)
    items: list[dict] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: Metadata | None = None


class ConversationUpdateRequest(BaseModel):
    """POST /v1/conversations/{id}: its metadata replaced."""
    model_config = ConfigDict(extra="forbid", strict=True)
    metadata: Metadata | None


class ItemsCreateRequest(BaseModel):
    """POST /v1/conversations/{id}/items."""
    model_config = ConfigDict(extra="forbid", strict=True)
    items: list[dict] = Field(max_length=MAX_ITEMS_PER_REQUEST)


def conversation_object(conversation_id: str, created_at: int, metadata: dict | None) -> dict:
    return {"id": conversation_id, "object": "conversation", "created_at": created_at, "metadata": metadata or {}}


def new_conversation(metadata: dict | None) -> dict:
    return conversation_object(new_id("conv"), int(time.time()), metadata)


def stored_items(items: list[dict], field: str = "items", taken: set[str] = frozenset()) -> list[dict]:
    """`items` as the conversation keeps them (OpenAI's shape, each with an id of its own or a new one);
    ParamError naming the first a response could not read, or whose id is no string of at most
    MAX_ITEM_ID_CHARS (without a NUL), or already in the conversation (`taken`) or in `items` before it."""
    input_messages(items, field)
    shown, seen = [], set(taken)
    for i, item in enumerate(items):
        item_id = item.get("id")
        if item_id is not None and (not isinstance(item_id, str) or not 0 < len(item_id) <= MAX_ITEM_ID_CHARS
                                    or "\x00" in item_id):  # (PostgreSQL refuses a NUL in a text field)
            raise ParamError(f"{field}[{i}].id", f"must be a string of 1 to {MAX_ITEM_ID_CHARS} characters, no NUL")
        if item_id in seen:
            raise ParamError(f"{field}[{i}].id", f"the conversation already holds an item with id {item_id!r}")
        shown.append(input_item(item, new_id("").removeprefix("_")))
        seen.add(shown[-1]["id"])
    return shown


def item_list(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def page(items: list[dict], after: str | None, limit: int, order: str, where: str) -> dict:
    """A list page of `items` (oldest first): `limit` (1-100) after the one `after` names, newest first
    unless `order` is `asc`; `where` names what holds them in the 404 of an unknown `after`."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit: must be from 1 to 100, got {limit}", param="limit")
    items = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(404, f"after: no item {after!r} in {where}", param="after")
        items = items[ids.index(after) + 1:]
    return item_list(items[:limit], len(items) > limit)
