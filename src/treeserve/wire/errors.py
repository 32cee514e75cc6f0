"""Errors in OpenAI's schema: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from treeserve.errors import EngineDeadError, ParamError

log = logging.getLogger("treeserve.server")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_exceeded",
               500: "internal_server_error", 502: "bad_gateway", 503: "service_unavailable"}


class APIError(Exception):
    """`error_type`: the body's `type` where it is not the status's (LiteLLM's proxy names some of its
    refusals, `budget_exceeded`, `key_model_access_denied`, and its users read them)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.error_type = error_type


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               error_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type or ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def failure_body(exc: Exception) -> dict:
    """The error object a stream that has begun ends with: an APIError as it is; anything else a 500
    whose cause stays in the server's log (logged here), never in the answer (paths, device messages)."""
    if isinstance(exc, APIError):
        return error_body(exc.status, exc.message, exc.param, exc.code, exc.error_type)
    if isinstance(exc, EngineDeadError):
        return error_body(503, str(exc), code="engine_dead")
    log.error("a stream failed once it had begun", exc_info=exc)
    return error_body(500, "internal error: the reply failed part way (the server's log has the cause)",
                      code="server_error")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, error_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, error_type), status_code=status, headers=headers)


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         502: "api_error", 503: "overloaded_error"}
ANTHROPIC_ROUTES = "/v1/messages"  # its routes answer errors in Anthropic's shape
# code -> the status Anthropic's API answers for it where OpenAI's (LiteLLM's proxy's) differs: a model the key
# may not use is its 403 permission_error; a 401 reads as a bad key there (the SDK's AuthenticationError,
# Claude Code's "please run /login")
ANTHROPIC_STATUSES = {"model_not_allowed": 403}


# codes Anthropic's clients act on, sent as its `error.details.error_code` (the tool runner sends the
# conversation without `thread` once told thread_unsupported_request)
ANTHROPIC_DETAIL_CODES = {"thread_unsupported_request"}


def anthropic_error(status: int, message: str, code: str | None = None) -> dict:
    error = {"type": ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error"), "message": message}
    if code in ANTHROPIC_DETAIL_CODES:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def error_response_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                       headers: dict[str, str] | None = None, error_type: str | None = None) -> JSONResponse:
    """The error in the shape of the API the path belongs to: Anthropic's on /v1/messages (its types
    by status, its statuses by ANTHROPIC_STATUSES), else OpenAI's."""
    if path.startswith(ANTHROPIC_ROUTES):
        status = ANTHROPIC_STATUSES.get(code, status)
        return JSONResponse(anthropic_error(status, message, code), status_code=status, headers=headers)
    return error_response(status, message, param, code, headers, error_type)


def from_value_error(exc: ValueError) -> APIError:
    """A 400 with the error's text; a ParamError also names its parameter for the client, and one with
    a code of its own (a ContextLengthError: OpenAI's for it) has it."""
    param = exc.param if isinstance(exc, ParamError) else None
    code = getattr(exc, "code", None) if isinstance(exc, ParamError) else None
    return APIError(400, str(exc), param=param, code=code if isinstance(code, str) else "invalid_value")


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "unsupported_parameter":  # (a field the vendor defines: wire/unsupported.py)
        return APIError(400, first["msg"], param=first["ctx"]["param"], code="unsupported_parameter")
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    loc = [p for p in _field_location(first.get("loc", ()), isinstance(exc, RequestValidationError))
           if not _is_union_tag(p)]
    param = param_name(loc)
    kind = first.get("type", "")
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
    if kind == "missing":
        message = f"{param}: this field is required"
    elif kind == "extra_forbidden":  # (OpenAI's and Anthropic's answer to a field they do not know)
        return APIError(400, f"{param}: unknown parameter", param=param, code="unknown_parameter")
    return APIError(400, message, param=param, code="missing_required_parameter" if kind == "missing" else "invalid_type")


def param_name(loc: list) -> str | None:
    """A field's location as OpenAI names it: list items by index in brackets (`tools[0].type`, not
    pydantic's `tools.0.type`), as ParamError's names are written."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name or None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
_REQUEST_PARTS = {"body", "query", "path", "header", "cookie"}  # (FastAPI's first element of a location)


def _field_location(loc: tuple, from_fastapi: bool) -> list:
    """The field's path without the part of the request FastAPI puts first (`query.limit` is `limit`, as
    OpenAI names a query parameter; `body` is dropped wherever pydantic puts it)."""
    parts = list(loc)
    if from_fastapi and parts and parts[0] in _REQUEST_PARTS:
        parts = parts[1:]
    return [part for part in parts if part != "body"]


def _is_union_tag(part) -> bool:
    """pydantic names the union member it tried ('str', 'list[int]', 'TextPart'); that is not a parameter."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response_for(request.url.path, exc.status, exc.message, exc.param, exc.code, exc.headers,
                                  exc.error_type)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = from_validation_error(exc)
        return error_response_for(request.url.path, err.status, err.message, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        return error_response_for(request.url.path, exc.status_code, message,
                                  code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return error_response_for(request.url.path, 503, str(exc), code="engine_dead")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response_for(request.url.path, 500, f"internal error: {type(exc).__name__}")
