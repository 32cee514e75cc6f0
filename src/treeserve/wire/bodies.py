"""Request bodies read within a size limit (413 past it) and parsed strictly into the wire models
(400 naming the field): the server's routes and the gateway's translated ones read them so."""
from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ValidationError

from treeserve.wire.errors import APIError, from_validation_error


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
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
