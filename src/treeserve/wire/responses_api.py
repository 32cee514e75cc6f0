"""The Responses API's routes over any chat completions: create (whole or streamed), retrieve,
input items, delete. The server runs it over its own chat serving with a bounded store in memory;
the gateway over its request path (billed as a chat) with a store in its database, per key."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from treeserve.wire.conversations import page
from treeserve.wire.conversations_api import ConversationsAPI
from treeserve.wire.errors import APIError, from_value_error
from treeserve.wire.responses import (InputTokensRequest, ResponsesRequest, chat_request, conversation,
                                      conversation_id_of, from_chat, input_item, new_id, skeleton)
from treeserve.wire.responses_stream import ResponseEvents
from treeserve.wire.responses_truncation import CountFn, check_fits, counted_fit, fitted
from treeserve.wire.translated_errors import RESPONSES, named_for
from treeserve.wire.translated_stream import translated_events

# a chat completions body in; its reply (a dict) or its chunks (an async iterator of dicts) out;
# APIError for a refusal
ChatFn = Callable[[dict], Awaitable["dict | AsyncIterator[dict]"]]
MAX_STORED_RESPONSES = 1000  # the server's store: the oldest go first


@dataclass
class StoredResponse:
    response: dict
    history: list[dict]      # the chat messages a following response continues from
    input_items: list[dict]  # the request's input, as items


class ResponseStore(Protocol):
    """`owner`: the key that made a response (its id on the gateway; None: the server's, and the master key)."""

    async def get(self, response_id: str, owner: int | None) -> StoredResponse | None: ...
    async def put(self, stored: StoredResponse, owner: int | None) -> None: ...
    async def delete(self, response_id: str, owner: int | None) -> bool: ...


class MemoryResponseStore:
    """The last `capacity` stored responses, by owner and id."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self.items: OrderedDict[tuple, StoredResponse] = OrderedDict()

    async def get(self, response_id: str, owner: int | None) -> StoredResponse | None:
        return self.items.get((owner, response_id))

    async def put(self, stored: StoredResponse, owner: int | None) -> None:
        self.items[(owner, stored.response["id"])] = stored
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    async def delete(self, response_id: str, owner: int | None) -> bool:
        return self.items.pop((owner, response_id), None) is not None


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (never stored, deleted, or made with "
                         "another key)", code="response_not_found")


def previous_not_found(response_id: str) -> APIError:
    """OpenAI's answer to a `previous_response_id` it does not hold: a 400 whose code clients act on (they
    send the whole conversation again), not the 404 of a retrieve."""
    return APIError(400, f"previous_response_id: Previous response with id {response_id!r} not found (never "
                         "stored, deleted, or made with another key)", param="previous_response_id",
                    code="previous_response_not_found")


def _input_items(input: str | list[dict]) -> list[dict]:
    """A request's `input` as items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": input}] if isinstance(input, str) else input


class ResponsesAPI:
    """`conversations`: where a response's `conversation` is kept (None: a 400 for one)."""

    def __init__(self, store: ResponseStore, conversations: ConversationsAPI | None = None):
        self.store, self.conversations = store, conversations

    async def create(self, request: ResponsesRequest, chat: ChatFn, model: str,
                     owner: int | None = None, count: CountFn | None = None) -> dict | AsyncIterator[str]:
        """The response (a dict), or its events on the wire (streamed). `count` (a chat's prompt
        tokens and the context's size, unbilled) lets `truncation: "auto"` find the turns to drop
        before the chat is sent. A stream that fails is stored as the failed response it ends with,
        as OpenAI's; a response in a `conversation` that does not fail has its input and output
        appended to it."""
        items = _input_items(request.input)
        history, added = await self._continued(request, items, owner)
        body = _chat_body(request, history, model)
        response = skeleton(request, new_id("resp"), model)
        with named_for(RESPONSES):  # (the chat's errors named as the fields the request sent)
            body, result = await fitted(body, chat, request.truncation, count)

        async def keep(final: dict) -> None:
            if request.store:
                await self.store.put(StoredResponse(final, conversation(history, body, final, request.instructions),
                                                    items), owner)
            if request.conversation is not None and final["status"] != "failed":
                await self.conversations.append(conversation_id_of(request.conversation), added + final["output"],
                                                owner)
        if isinstance(result, dict):
            final = from_chat(response, result)
            await keep(final)
            return final
        events = ResponseEvents(response)
        return translated_events(events, result, lambda: keep(events.response))

    async def input_tokens(self, request: InputTokensRequest, count: CountFn, model: str,
                           owner: int | None = None) -> dict:
        """The input tokens a response made of these fields is charged (its chat's prompt tokens),
        `truncation` applied as the response would: with "auto", of what is left once the oldest turns
        that cannot fit are dropped; an input that cannot fit (with "disabled", the default, or its last
        turn alone with "auto") is the response's context-length 400, where the count knows the context."""
        response = request.as_response()
        history, _ = await self._continued(response, _input_items(response.input), owner)
        body = _chat_body(response, history, model)
        with named_for(RESPONSES):
            if request.truncation == "auto":
                body = await counted_fit(body, count)
            counted = await count(body)
            check_fits(body, counted)
        return {"object": "response.input_tokens", "input_tokens": counted.tokens}

    async def _continued(self, request: ResponsesRequest, items: list[dict],
                         owner: int | None) -> tuple[list[dict], list[dict]]:
        """(the chat messages the response continues from, the items it adds to its conversation): those
        of its `conversation`, or of its `previous_response_id` (nothing to add), never both (OpenAI's 400)."""
        if request.conversation is None:
            return await self._history(request.previous_response_id, owner), []
        if request.previous_response_id is not None:
            raise APIError(400, "Mutually exclusive parameters: Ensure you are only providing one of: "
                                "'previous_response_id' or 'conversation'.", param="conversation",
                           code="mutually_exclusive_parameters")
        if self.conversations is None:
            raise APIError(400, "conversation: not supported here (no conversations are kept); use "
                                "previous_response_id", param="conversation", code="unsupported_parameter")
        try:
            conversation_id = conversation_id_of(request.conversation)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return await self.conversations.continued(conversation_id, items, owner)

    async def _history(self, previous_response_id: str | None, owner: int | None) -> list[dict]:
        """The chat messages a response continues from (none without `previous_response_id`)."""
        if previous_response_id is None:
            return []
        previous = await self.store.get(previous_response_id, owner)
        if previous is None:
            raise previous_not_found(previous_response_id)
        return previous.history

    async def retrieve(self, response_id: str, owner: int | None = None) -> dict:
        return (await self._stored(response_id, owner)).response

    async def input_items(self, response_id: str, owner: int | None = None, after: str | None = None,
                          limit: int = 20, order: str = "desc") -> dict:
        """The response's input items as OpenAI lists them (each typed, with an id, a status and, for
        a message, content parts), a page at a time: `limit` (1-100) items after the one `after`
        names, newest first unless `order` is `asc`."""
        stored = await self._stored(response_id, owner)
        items = [input_item(item, f"{response_id.removeprefix('resp_')}_{i}")
                 for i, item in enumerate(stored.input_items)]
        return page(items, after, limit, order, f"response {response_id!r}")

    async def delete(self, response_id: str, owner: int | None = None) -> dict:
        if not await self.store.delete(response_id, owner):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def _stored(self, response_id: str, owner: int | None) -> StoredResponse:
        stored = await self.store.get(response_id, owner)
        if stored is None:
            raise not_found(response_id)
        return stored


def _chat_body(request: ResponsesRequest, history: list[dict], model: str) -> dict:
    try:
        body = chat_request(request, history)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    return body | {"model": model}
