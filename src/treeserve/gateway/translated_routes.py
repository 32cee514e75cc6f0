"""OpenAI's Responses API and Anthropic's Messages API on the gateway, translated to chat completions
(wire/responses.py, wire/messages.py) and sent through the request path as chats (`GatewayService.dispatch`:
the key's models, limits and budget, routing and fallbacks, billed like a chat). Stored responses
live in the gateway's database, per key (gateway/response_store.py), as do conversations
(gateway/conversation_store.py, the Conversations API's routes: wire/conversations_routes.py); token
counts are the backend's (`/tokenize`, unbilled)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from treeserve.gateway.auth import Auth
from treeserve.gateway.chat.upstream import UpstreamError, stream_events
from treeserve.gateway.conversation_store import DatabaseConversationStore
from treeserve.gateway.fields import NO_NUL, PathId
from treeserve.gateway.keys import KeyRecord
from treeserve.gateway.response_store import DatabaseResponseStore
from treeserve.gateway.service import GatewayService
from treeserve.wire.bodies import parse
from treeserve.wire.conversations_api import ConversationsAPI
from treeserve.wire.conversations_routes import REQUEST_MODELS as CONVERSATION_MODELS, conversations_routes
from treeserve.wire.disconnect import unless_client_leaves
from treeserve.wire.errors import APIError
from treeserve.wire.messages import CountTokensRequest, MessagesRequest, from_chat
from treeserve.wire.messages_stream import MessageEvents
from treeserve.wire.responses import InputTokensRequest, ResponsesRequest
from treeserve.wire.responses_api import ResponsesAPI
from treeserve.wire.responses_truncation import PromptCount
from treeserve.wire.translated_errors import MESSAGES, named_for
from treeserve.wire.translated_stream import event_stream, translated_events

CHAT = "/v1/chat/completions"
REQUEST_MODELS = {"/v1/responses": ResponsesRequest, "/v1/responses/input_tokens": InputTokensRequest,
                  "/v1/messages": MessagesRequest,
                  "/v1/messages/count_tokens": CountTokensRequest} | CONVERSATION_MODELS


def translated_routes(service: GatewayService, auth: Auth, store: DatabaseResponseStore,
                      conversation_store: DatabaseConversationStore, max_body_bytes: int):
    routes = APIRouter()
    conversations = ConversationsAPI(conversation_store)
    api = ResponsesAPI(store, conversations)

    def key_id(key: KeyRecord = Depends(auth.require_key)) -> int | None:
        return key.id
    routes.include_router(conversations_routes(conversations, key_id, max_body_bytes))

    def chat_on(key: KeyRecord, ids: list[str]):
        async def chat(body: dict):
            return await relay_chat(service, body, key, ids)
        return chat

    def counting_on(key: KeyRecord, ids: list[str]):
        async def count(chat: dict) -> PromptCount:  # (a backend's /tokenize: unbilled, as count_tokens)
            response = await service.count_tokens(tokenized_chat(chat), key)
            if "x-request-id" in response.headers:
                ids.append(response.headers["x-request-id"])
            reply = _reply(response)
            size = reply.get("max_model_len")  # (vLLM's and treeserve's /tokenize say it)
            return PromptCount(_count(reply), size if isinstance(size, int) and size > 0 else None)
        return count

    @routes.post("/v1/responses")
    async def create_response(request: Request, key: KeyRecord = Depends(auth.require_key)):
        body = _with_model(await parse(request, ResponsesRequest, max_body_bytes))
        ids: list[str] = []
        result = await unless_client_leaves(request, api.create(body, chat_on(key, ids), body.model, key.id,
                                                                counting_on(key, [])), idempotent=False)
        return _with_request_id(JSONResponse(result) if isinstance(result, dict) else event_stream(result), ids)

    @routes.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request, key: KeyRecord = Depends(auth.require_key)):
        body = _with_model(await parse(request, InputTokensRequest, max_body_bytes))
        ids: list[str] = []
        return _with_request_id(JSONResponse(await api.input_tokens(body, counting_on(key, ids), body.model,
                                                                    key.id)), ids)

    @routes.get("/v1/responses/{response_id}")
    async def retrieve(response_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return await api.retrieve(response_id, key.id)

    @routes.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: PathId, after: str | None = Query(None, max_length=128, pattern=NO_NUL),
                          limit: int = 20, order: Literal["asc", "desc"] = "desc",
                          key: KeyRecord = Depends(auth.require_key)):
        return await api.input_items(response_id, key.id, after, limit, order)

    @routes.delete("/v1/responses/{response_id}")
    async def delete(response_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return await api.delete(response_id, key.id)

    @routes.post("/v1/messages")
    async def messages(request: Request, key: KeyRecord = Depends(auth.require_key)):
        body = await parse(request, MessagesRequest, max_body_bytes)
        ids: list[str] = []
        chat = body.chat_request()  # (a ParamError: http_errors' 400)
        with named_for(MESSAGES):
            result = await unless_client_leaves(request, relay_chat(service, chat, key, ids), idempotent=False)
        if isinstance(result, dict):
            return _with_request_id(JSONResponse(from_chat(body, body.model, result)), ids)
        return _with_request_id(event_stream(translated_events(MessageEvents(body, body.model), result)), ids)

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request, key: KeyRecord = Depends(auth.require_key)):
        body = await parse(request, CountTokensRequest, max_body_bytes)
        with named_for(MESSAGES):
            response = await service.count_tokens(body.chat_fields(), key)
        ids = [response.headers["x-request-id"]] if "x-request-id" in response.headers else []
        return _with_request_id(JSONResponse({"input_tokens": _count(_reply(response))}), ids)

    return routes


async def relay_chat(service: GatewayService, body: dict, key: KeyRecord, ids: list[str]) -> dict | AsyncIterator[dict]:
    """A chat through the request path: its reply, or its chunks; a refusal or a backend's error
    raises APIError with the backend's status and message. The chat's request id (its `spend_logs`
    row's) is appended to `ids`."""
    response = await service.dispatch(CHAT, body, key)
    request_id = response.headers.get("x-request-id")
    if request_id is not None:
        ids.append(request_id)
    if isinstance(response, StreamingResponse):
        return _chunks(response)
    return _reply(response)


def _with_request_id(response: Response, ids: list[str]) -> Response:
    """The translated answer carries its chat's `x-request-id`, as a relayed one does."""
    if ids:
        response.headers["x-request-id"] = ids[-1]
    return response


def _reply(response: Response) -> dict:
    try:
        payload = json.loads(response.body)
    except ValueError:
        payload = {}
    if response.status_code != 200:
        error = payload.get("error") if isinstance(payload, dict) else None
        error = error if isinstance(error, dict) else {}
        headers = {name: response.headers[name] for name in ("x-request-id", "retry-after") if name in response.headers}
        raise APIError(response.status_code, error.get("message") or f"the backend answered {response.status_code}",
                       param=error.get("param"), code=error.get("code"), headers=headers or None)
    return payload


async def _chunks(response: StreamingResponse) -> AsyncIterator[dict]:
    """A relayed chat stream's chunks (gateway/chat/upstream.py reads them, as the web chat does); its
    error event raises APIError; the relay is closed (and so settled) however the reading ends."""
    events = stream_events(response)
    try:
        async for chunk in events:
            yield chunk
    except UpstreamError as exc:
        raise APIError(502, str(exc), code="backend_stream_cut") from exc
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()


def _count(reply) -> int:
    """A backend's /tokenize answer's `count` (vLLM's and treeserve's); a 502 where it has none (another
    server's shape: llama.cpp's gives its `tokens` only), so a count that cannot be made is a backend's
    failure, which truncation's counting falls back from."""
    count = reply.get("count") if isinstance(reply, dict) else None
    if not isinstance(count, int) or isinstance(count, bool):
        raise APIError(502, "the backend's /tokenize answered without a count of the tokens", code="backend_error")
    return count


def tokenized_chat(chat: dict) -> dict:
    """A chat body as a backend's /tokenize renders the chat's prompt: with the tools an allowed_tools
    choice names only (the chat's prompt lists those; a /tokenize, vLLM's as treeserve's, takes no
    tool_choice). A malformed choice is left as it is: the chat's 400 names it."""
    choice = chat.get("tool_choice")
    allowed = choice.get("allowed_tools") if isinstance(choice, dict) and choice.get("type") == "allowed_tools" else None
    named = allowed.get("tools") if isinstance(allowed, dict) else None
    if not isinstance(named, list) or not isinstance(chat.get("tools"), list):
        return chat
    names = {(tool.get("function") or {}).get("name") for tool in named if isinstance(tool, dict)}
    return chat | {"tools": [tool for tool in chat["tools"]
                             if isinstance(tool, dict) and (tool.get("function") or {}).get("name") in names]}


def _with_model(body):
    """A Responses body that names its model (the gateway routes by it; the server may default one)."""
    if body.model is None:
        raise APIError(400, "model: this field is required", param="model", code="missing_required_parameter")
    return body
