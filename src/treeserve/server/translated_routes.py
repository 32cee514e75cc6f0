"""The routes served by translating to chat completions: OpenAI's Responses API (wire/responses_api.py,
stored responses in memory, bounded) with its Conversations API (wire/conversations_routes.py, in
memory, bounded), and Anthropic's Messages API (wire/messages.py), over the served model's chat serving."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from treeserve.wire.disconnect import unless_client_leaves
from treeserve.wire.bodies import parse
from treeserve.wire.conversations_api import ConversationsAPI, MemoryConversationStore
from treeserve.wire.conversations_routes import REQUEST_MODELS as CONVERSATION_MODELS, conversations_routes
from treeserve.wire.errors import from_value_error
from treeserve.wire.messages import CountTokensRequest, MessagesRequest, from_chat
from treeserve.wire.messages_stream import MessageEvents
from treeserve.wire.responses import InputTokensRequest, ResponsesRequest
from treeserve.wire.responses_api import MemoryResponseStore, ResponsesAPI
from treeserve.wire.responses_truncation import PromptCount
from treeserve.wire.translated_errors import MESSAGES, named_for
from treeserve.wire.translated_stream import event_stream, translated_events

REQUEST_MODELS = {"/v1/responses": ResponsesRequest, "/v1/responses/input_tokens": InputTokensRequest,
                  "/v1/messages": MessagesRequest,
                  "/v1/messages/count_tokens": CountTokensRequest} | CONVERSATION_MODELS


def responses_routes(served, max_body_bytes: int) -> APIRouter:
    """`served`: server/routes.py's ServedModels."""
    router = APIRouter()
    conversations = ConversationsAPI(MemoryConversationStore())
    api = ResponsesAPI(MemoryResponseStore(), conversations)
    router.include_router(conversations_routes(conversations, _no_owner, max_body_bytes))

    @router.post("/v1/responses")
    async def create(request: Request):
        body = await parse(request, ResponsesRequest, max_body_bytes)
        serving = served.meant_generator(body.model)
        result = await unless_client_leaves(request, api.create(body, serving.chat_body, serving.model_name,
                                                                count=_counter(serving)))
        return JSONResponse(result) if isinstance(result, dict) else event_stream(result)

    @router.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request):
        body = await parse(request, InputTokensRequest, max_body_bytes)
        serving = served.meant_generator(body.model)
        return await api.input_tokens(body, _counter(serving), serving.model_name)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return await api.retrieve(response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, after: str | None = None, limit: int = 20,
                          order: Literal["asc", "desc"] = "desc"):
        return await api.input_items(response_id, None, after, limit, order)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        return await api.delete(response_id)

    return router


def _no_owner() -> None:
    """The server's conversations are its own (its API keys all reach the same ones)."""
    return None


def _counter(serving):
    """A chat body's prompt tokens, as `serving` renders them (nothing generated), and its context."""
    async def count(chat: dict) -> PromptCount:
        return PromptCount(len(serving.render_body(chat)), serving.max_model_len)
    return count


def messages_routes(served, max_body_bytes: int) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def create(request: Request):
        body = await parse(request, MessagesRequest, max_body_bytes)
        serving = served.generator(body.model)
        with named_for(MESSAGES):
            result = await unless_client_leaves(request, serving.chat_body(_translated(body.chat_request)))
        if isinstance(result, dict):
            return JSONResponse(from_chat(body, serving.model_name, result))
        return event_stream(translated_events(MessageEvents(body, serving.model_name), result))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await parse(request, CountTokensRequest, max_body_bytes)
        serving = served.serving(body.model)
        with named_for(MESSAGES):
            return {"input_tokens": len(serving.render_body(_translated(body.chat_fields)))}

    return router


def _translated(translate):
    """A Messages request's chat fields; what cannot be translated is a 400 naming its field."""
    try:
        return translate()
    except ValueError as exc:
        raise from_value_error(exc) from exc
