"""Request bodies read within a size limit (413 past it) and parsed strictly into the wire models
(400 naming the field): the server's routes and the gateway's translated ones read them so."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from treeserve.errors import ParamError
from treeserve.wire.errors import APIError, error_response_for, from_validation_error, from_value_error


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for piece in request.stream():
        body.extend(piece)
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    return bytes(body)


async def parse(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    return validated(await read_body(request, limit), model)


async def parse_chosen(request: Request, choose: Callable[[Any], type[BaseModel]], limit: int) -> BaseModel:
    """A body that may be one of several models, `choose` telling which from the parsed JSON (None when
    it is no JSON: the model's validation says why); its ParamError is a 400 naming the field."""
    body = await read_body(request, limit)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    try:
        model = choose(data)
    except ParamError as exc:
        raise from_value_error(exc) from exc
    return validated(body, model)


def validated(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


class BodyTooLarge(Exception):
    """Raised from a request's receive channel once its body passed its limit (BodyLimitMiddleware)."""


class BodyLimitMiddleware:
    """Every request body within a limit, checked before any route reads it: a declared
    Content-Length past it is a 413 at once, and a body sent without one (chunked) is cut off at the
    limit with a 413. FastAPI parses a route's declared body (a pydantic model, a form) before the
    route's dependencies run, its key check among them, so without this any client, signed in or
    not, could make the app hold a body of any size in memory (or a multipart upload on disk).
    `limit(path)` is the limit of a path. A plain ASGI middleware: the receive channel otherwise
    passes through untouched (a client's disconnect still reaches the routes)."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, limit = scope["path"], self.limit(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(path, f"request body is {declared} bytes; the limit is {limit}")(scope, receive, send)
            return
        received, over, started = 0, False, False

        async def limited_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if over:  # whatever the app made of the cut body (FastAPI: a 400) gives way to the 413
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:  # BodyTooLarge, or what the app raised on it (FastAPI wraps it)
            if not over:
                raise
        if over and not started:
            await _too_large(path, f"request body exceeds the limit of {limit} bytes")(scope, receive, send)


def _too_large(path: str, message: str):
    return error_response_for(path, 413, message, code="body_too_large", headers={"Connection": "close"})
