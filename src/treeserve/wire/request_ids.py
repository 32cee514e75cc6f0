"""Anthropic's request ids on its routes (/v1/messages...): every answer carries a `request-id`
header, and an error body its `request_id` (Anthropic's clients read the header into a message's
`_request_id` and an error's `request_id`). The id is the answer's `x-request-id` where it has one
(the gateway's: its spend_logs row's), else a new `req_` one. A plain ASGI middleware, installed
outermost (the key check's 401, the drain's 503 and a body's 413 carry it too).

vLLM's `--enable-request-id-headers` (`treeserve serve`'s too): every answer's `X-Request-Id`, the
request's own `X-Request-Id` when it sent one, else a new uuid4 hex (OpenAI's clients read it into
`_request_id`). Off by default, as in vLLM."""
from __future__ import annotations

import json
import uuid

from treeserve.wire.errors import ANTHROPIC_ROUTES


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class AnthropicRequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(ANTHROPIC_ROUTES):
            await self.app(scope, receive, send)
            return
        held: dict = {}  # an error's start, held until its body is read

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                given = dict(headers).get(b"x-request-id")
                request_id = given.decode("latin-1") if given else new_request_id()
                message = dict(message, headers=headers + [(b"request-id", request_id.encode("latin-1"))])
                if message["status"] >= 400 and _is_json(headers):
                    held.update(start=message, request_id=request_id, body=b"")
                    return
            elif message["type"] == "http.response.body" and held:
                held["body"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                start, body = _with_request_id(held["start"], held["body"], held["request_id"])
                held.clear()
                await send(start)
                message = {"type": "http.response.body", "body": body}
            await send(message)

        await self.app(scope, receive, send_with_id)


class XRequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or () if k.lower() != b"x-request-id"]
                message = dict(message, headers=headers + [(b"x-request-id", request_id)])
            await send(message)

        await self.app(scope, receive, send_with_id)


def _is_json(headers) -> bool:
    return dict(headers).get(b"content-type", b"").startswith(b"application/json")


def _with_request_id(start: dict, body: bytes, request_id: str) -> tuple[dict, bytes]:
    """An Anthropic error body with its `request_id`, and its start with the new length."""
    try:
        error = json.loads(body)
    except ValueError:
        return start, body
    if not isinstance(error, dict) or error.get("type") != "error":
        return start, body
    body = json.dumps(error | {"request_id": request_id}, separators=(",", ":")).encode()
    headers = [(name, value) for name, value in start["headers"] if name != b"content-length"]
    return dict(start, headers=headers + [(b"content-length", str(len(body)).encode())]), body
