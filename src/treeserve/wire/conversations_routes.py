"""The Conversations API's routes (`/v1/conversations`...), over ConversationsAPI: the server mounts
them with no owner (its one store), the gateway with the key's id as the owner (`owner`: a FastAPI
dependency answering it), so one key's conversations are not found with another."""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from treeserve.wire.bodies import parse
from treeserve.wire.conversations import (MAX_ITEM_ID_CHARS, ConversationCreateRequest, ConversationUpdateRequest,
                                          ItemsCreateRequest)
from treeserve.wire.conversations_api import ConversationsAPI

NO_NUL = r"^[^\x00]*$"  # (no id holds one; PostgreSQL refuses it in a text field)
ConversationId = Annotated[str, Path(max_length=64, pattern=NO_NUL)]
ItemId = Annotated[str, Path(max_length=MAX_ITEM_ID_CHARS, pattern=NO_NUL)]
REQUEST_MODELS = {"/v1/conversations": ConversationCreateRequest,
                  "/v1/conversations/{conversation_id}": ConversationUpdateRequest,
                  "/v1/conversations/{conversation_id}/items": ItemsCreateRequest}


def conversations_routes(api: ConversationsAPI, owner: Callable, max_body_bytes: int) -> APIRouter:
    router = APIRouter()
    kept_by = Depends(owner)

    @router.post("/v1/conversations")
    async def create(request: Request, who: int | None = kept_by):
        body = await parse(request, ConversationCreateRequest, max_body_bytes)
        return await api.create(body.items, body.metadata, who)

    @router.get("/v1/conversations/{conversation_id}")
    async def retrieve(conversation_id: ConversationId, who: int | None = kept_by):
        return await api.retrieve(conversation_id, who)

    @router.post("/v1/conversations/{conversation_id}")
    async def update(conversation_id: ConversationId, request: Request, who: int | None = kept_by):
        body = await parse(request, ConversationUpdateRequest, max_body_bytes)
        return await api.update(conversation_id, body.metadata, who)

    @router.delete("/v1/conversations/{conversation_id}")
    async def delete(conversation_id: ConversationId, who: int | None = kept_by):
        return await api.delete(conversation_id, who)

    @router.get("/v1/conversations/{conversation_id}/items")
    async def list_items(conversation_id: ConversationId,
                         after: str | None = Query(None, max_length=MAX_ITEM_ID_CHARS, pattern=NO_NUL),
                         limit: int = 20, order: Literal["asc", "desc"] = "desc", who: int | None = kept_by):
        return await api.list_items(conversation_id, who, after, limit, order)

    @router.post("/v1/conversations/{conversation_id}/items")
    async def add_items(conversation_id: ConversationId, request: Request, who: int | None = kept_by):
        body = await parse(request, ItemsCreateRequest, max_body_bytes)
        return await api.add_items(conversation_id, body.items, who)

    @router.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def retrieve_item(conversation_id: ConversationId, item_id: ItemId, who: int | None = kept_by):
        return await api.retrieve_item(conversation_id, item_id, who)

    @router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: ConversationId, item_id: ItemId, who: int | None = kept_by):
        return await api.delete_item(conversation_id, item_id, who)

    return router
