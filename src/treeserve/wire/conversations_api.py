"""The Conversations API's operations over a store of conversations, per owner (a key on the gateway,
as stored responses are: another key's conversation is not found): create, retrieve, update its
metadata, delete; list, add, retrieve and delete its items; and for the Responses API, the chat
messages a conversation holds and the appending of a response's input and output. The server keeps
its conversations in memory (bounded), the gateway in its database (gateway/conversation_store.py)."""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from treeserve.errors import ParamError
from treeserve.wire.conversations import (MAX_ITEMS_PER_CONVERSATION, ConversationFull, ItemIdTaken, check_append,
                                          new_conversation, page, stored_items)
from treeserve.wire.errors import APIError, from_value_error
from treeserve.wire.responses import input_messages

MAX_CONVERSATIONS = 1000  # the server's store: the least recently written go first
log = logging.getLogger(__name__)


class ConversationStore(Protocol):
    """`owner`: the key a conversation belongs to (its id on the gateway; None: the server's, and the
    master key). Each call answers None (or False) for a conversation the owner does not hold. `append`
    checks, as it appends (check_append), that no item's id is taken and that `limit` is kept."""

    async def create(self, conversation: dict, items: list[dict], owner: int | None) -> None: ...
    async def get(self, conversation_id: str, owner: int | None) -> dict | None: ...
    async def set_metadata(self, conversation_id: str, metadata: dict, owner: int | None) -> dict | None: ...
    async def delete(self, conversation_id: str, owner: int | None) -> bool: ...
    async def items(self, conversation_id: str, owner: int | None) -> list[dict] | None: ...
    async def append(self, conversation_id: str, items: list[dict], owner: int | None,
                     limit: int | None) -> bool: ...
    async def delete_item(self, conversation_id: str, item_id: str, owner: int | None) -> bool: ...


@dataclass
class _Kept:
    conversation: dict
    items: list[dict] = field(default_factory=list)


class MemoryConversationStore:
    """The last `capacity` conversations written, by owner and id."""

    def __init__(self, capacity: int = MAX_CONVERSATIONS):
        self.capacity = capacity
        self.kept: OrderedDict[tuple, _Kept] = OrderedDict()

    async def create(self, conversation: dict, items: list[dict], owner: int | None) -> None:
        self.kept[(owner, conversation["id"])] = _Kept(conversation, list(items))
        self._bound()

    async def get(self, conversation_id: str, owner: int | None) -> dict | None:
        kept = self.kept.get((owner, conversation_id))
        return kept.conversation if kept else None

    async def set_metadata(self, conversation_id: str, metadata: dict, owner: int | None) -> dict | None:
        kept = self.kept.get((owner, conversation_id))
        if kept is None:
            return None
        kept.conversation = dict(kept.conversation, metadata=metadata)
        return kept.conversation

    async def delete(self, conversation_id: str, owner: int | None) -> bool:
        return self.kept.pop((owner, conversation_id), None) is not None

    async def items(self, conversation_id: str, owner: int | None) -> list[dict] | None:
        kept = self.kept.get((owner, conversation_id))
        return list(kept.items) if kept else None

    async def append(self, conversation_id: str, items: list[dict], owner: int | None,
                     limit: int | None) -> bool:
        kept = self.kept.get((owner, conversation_id))
        if kept is None:
            return False
        held = {item["id"] for item in kept.items}
        check_append(len(kept.items), [item["id"] for item in items if item["id"] in held], len(items), limit)
        kept.items += items
        self.kept.move_to_end((owner, conversation_id))
        return True

    async def delete_item(self, conversation_id: str, item_id: str, owner: int | None) -> bool:
        kept = self.kept.get((owner, conversation_id))
        if kept is None or all(item["id"] != item_id for item in kept.items):
            return False
        kept.items = [item for item in kept.items if item["id"] != item_id]
        return True

    def _bound(self) -> None:
        while len(self.kept) > self.capacity:
            self.kept.popitem(last=False)


def not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Conversation with id {conversation_id!r} not found (never made, deleted, or made "
                         "with another key)", param=param, code="conversation_not_found")


def conversation_full(exc: ConversationFull, param: str) -> APIError:
    room = max(MAX_ITEMS_PER_CONVERSATION - exc.held, 0)
    return APIError(400, f"{param}: the conversation holds {exc.held} items, at most {MAX_ITEMS_PER_CONVERSATION}: "
                         f"{exc.adding} more do not fit ({room} would); delete some of its items, or start a new "
                         "conversation", param=param, code="conversation_full")


def item_not_found(conversation_id: str, item_id: str) -> APIError:
    return APIError(404, f"no item {item_id!r} in conversation {conversation_id!r}", code="item_not_found")


class ConversationsAPI:
    def __init__(self, store: ConversationStore):
        self.store = store

    async def create(self, items: list[dict] | None, metadata: dict | None, owner: int | None = None) -> dict:
        conversation = new_conversation(metadata)
        await self.store.create(conversation, _checked(items or []), owner)
        return conversation

    async def retrieve(self, conversation_id: str, owner: int | None = None) -> dict:
        conversation = await self.store.get(conversation_id, owner)
        if conversation is None:
            raise not_found(conversation_id)
        return conversation

    async def update(self, conversation_id: str, metadata: dict | None, owner: int | None = None) -> dict:
        conversation = await self.store.set_metadata(conversation_id, metadata or {}, owner)
        if conversation is None:
            raise not_found(conversation_id)
        return conversation

    async def delete(self, conversation_id: str, owner: int | None = None) -> dict:
        if not await self.store.delete(conversation_id, owner):
            raise not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def list_items(self, conversation_id: str, owner: int | None = None, after: str | None = None,
                         limit: int = 20, order: str = "desc") -> dict:
        return page(await self._items(conversation_id, owner), after, limit, order,
                    f"conversation {conversation_id!r}")

    async def add_items(self, conversation_id: str, items: list[dict], owner: int | None = None) -> dict:
        """The items added, as a list (OpenAI's answer), in the order sent."""
        held = await self._items(conversation_id, owner)
        added = _checked(items, {item["id"] for item in held})
        try:
            appended = await self.store.append(conversation_id, added, owner, MAX_ITEMS_PER_CONVERSATION)
        except ConversationFull as exc:
            raise conversation_full(exc, "items") from None
        except ItemIdTaken as exc:  # (added by another request since `held` was read)
            where = [item["id"] for item in added].index(exc.item_id)
            raise from_value_error(ParamError(f"items[{where}].id", str(exc))) from None
        if not appended:
            raise not_found(conversation_id)
        return page(added, None, max(len(added), 1), "asc", "")

    async def retrieve_item(self, conversation_id: str, item_id: str, owner: int | None = None) -> dict:
        for item in await self._items(conversation_id, owner):
            if item["id"] == item_id:
                return item
        raise item_not_found(conversation_id, item_id)

    async def delete_item(self, conversation_id: str, item_id: str, owner: int | None = None) -> dict:
        """The conversation (OpenAI's answer), the item gone from it."""
        conversation = await self.retrieve(conversation_id, owner)
        if not await self.store.delete_item(conversation_id, item_id, owner):
            raise item_not_found(conversation_id, item_id)
        return conversation

    # ---- for the Responses API ------------------------------------------------------------------
    async def continued(self, conversation_id: str, input_items: list[dict],
                        owner: int | None) -> tuple[list[dict], list[dict]]:
        """For a response's `conversation`: (the chat messages its items make, the response's input as
        the items it will add); a 404 naming `conversation` when the owner holds none of that id, a
        400 naming an input item whose id the conversation holds."""
        items = await self.store.items(conversation_id, owner)
        if items is None:
            raise not_found(conversation_id, param="conversation")
        if len(items) + len(input_items) + 1 > MAX_ITEMS_PER_CONVERSATION:  # (its input, and an output item)
            raise conversation_full(ConversationFull(len(items), len(input_items) + 1), "conversation")
        try:
            return (input_messages(items, "conversation.items"),
                    stored_items(input_items, "input", {item["id"] for item in items}))
        except ValueError as exc:
            raise from_value_error(exc) from exc

    async def append(self, conversation_id: str, items: list[dict], owner: int | None) -> None:
        """A response's items appended (none where the conversation was deleted meanwhile), whole: its
        room was checked before it ran (`continued`; responses running at once may each take theirs);
        an input item whose id another request added meanwhile is not added twice."""
        while True:
            try:
                await self.store.append(conversation_id, items, owner, None)
                return
            except ItemIdTaken as exc:
                log.warning("conversation %s: input item %r was added meanwhile; kept once", conversation_id,
                            exc.item_id)
                items = [item for item in items if item["id"] != exc.item_id]

    async def _items(self, conversation_id: str, owner: int | None) -> list[dict]:
        items = await self.store.items(conversation_id, owner)
        if items is None:
            raise not_found(conversation_id)
        return items


def _checked(items: list[dict], taken: set[str] = frozenset()) -> list[dict]:
    try:
        return stored_items(items, "items", taken)
    except ValueError as exc:
        raise from_value_error(exc) from exc
