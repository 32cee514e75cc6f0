"""`/openapi.json` (and `/docs`) from the pydantic models that validate the request bodies.

The routes read and validate their bodies themselves (a size limit first, then the model, errors
in OpenAI's schema), so FastAPI does not see the models; this adds each route's body schema, the
error schema and the status codes the routes answer with, from the same models.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from treeserve.wire.errors import ANTHROPIC_ROUTES

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                         "properties": {"type": {"type": "string"},
                                                                        "message": {"type": "string"}}}},
}
ERROR_CODES = {"400": "invalid request", "401": "missing or invalid API key", "404": "unknown model",
               "413": "body too large", "429": "queue full (see Retry-After)", "503": "engine failed"}


def install(app: FastAPI, bodies: dict[str, type[BaseModel]], required: tuple[str, ...] = ()) -> None:
    """`bodies`: POST path -> the model its body must satisfy; `required`: fields every body must have
    here though its model may leave them out (the gateway routes by `model`, which a server defaults)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, bodies, required)
        return app.openapi_schema
    app.openapi = openapi


def _build(app: FastAPI, bodies: dict[str, type[BaseModel]], required: tuple[str, ...]) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible inference and test-time search")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    for path, model in bodies.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
        components.update(body.pop("$defs", {}))
        _require(body, required)
        components[model.__name__] = body
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        operation["responses"] = _responses()
    components["AnthropicError"] = ANTHROPIC_ERROR_SCHEMA
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            _document_errors(operation["responses"], "AnthropicError" if path.startswith(ANTHROPIC_ROUTES) else "Error")
    return schema


def _require(body: dict, fields: tuple[str, ...]) -> None:
    """`fields` (those the body has) made required in its schema, its null left out of their types."""
    for field in fields:
        schema = body.get("properties", {}).get(field)
        if schema is None:
            continue
        body["required"] = body.get("required", []) + ([field] if field not in body.get("required", []) else [])
        kinds = [kind for kind in schema.get("anyOf", []) if kind.get("type") != "null"]
        if len(kinds) == 1:  # (`str | None = None`: a string here)
            schema.pop("anyOf")
            schema.pop("default", None)
            schema.update(kinds[0])


def _document_errors(responses: dict, shape: str) -> None:
    """Every route answers errors in OpenAI's schema, Anthropic's routes in theirs (FastAPI's own 422
    never comes: bodies and path parameters are validated here, into 400 and 404)."""
    responses.pop("422", None)
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}
    for code, text in ERROR_CODES.items():
        responses.setdefault(code, {"description": text, **error})


def _responses() -> dict:
    return {"200": {"description": "the result (JSON, or server-sent events with stream: true)"}}
