"""The one place where the gateway's domain errors (gateway/errors.py) become HTTP answers: their
status, OpenAI error code and headers; the message and `param` are the error's own."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from treeserve.gateway.auth import logged_path
from treeserve.gateway.database import DATABASE_ERRORS, database_down
from treeserve.gateway.errors import (AccountGone, AliasReserved, AliasTaken, BatchConflict, BatchNotFound, BudgetExceeded,
                                      ChatKeyBlocked, ChatKeyOwner, ConversationNotFound, DatabaseUnavailable, FileNotFound,
                                      GatewayError, KeyNotFound, KeyTaken, KeyTeamNotFound, LimitExceeded, MemberExists,
                                      MemberNotFound, MessageNotFound, ModelsOutsideTeam, ParallelLimitExceeded,
                                      RateLimitExceeded, TeamBlocked, TeamExists, TeamNotFound, UserExists, UserNotFound)
from treeserve.wire.errors import APIError, error_response_for, from_value_error

# error class -> (HTTP status, OpenAI error code); a subclass not listed answers as its parent
HTTP_STATUS: dict[type[GatewayError], tuple[int, str | None]] = {
    UserExists: (400, "user_exists"),
    AliasTaken: (400, "key_alias_exists"),
    KeyTaken: (400, "key_exists"),
    AliasReserved: (400, "key_alias_reserved"),
    ChatKeyOwner: (400, "chat_key_owner"),
    UserNotFound: (404, "user_not_found"),
    KeyNotFound: (404, "key_not_found"),
    KeyTeamNotFound: (400, "team_not_found"),
    TeamNotFound: (404, "team_not_found"),
    TeamExists: (400, "team_exists"),
    ModelsOutsideTeam: (400, "model_not_in_team"),
    MemberExists: (400, "member_exists"),
    MemberNotFound: (400, "member_not_found"),
    ParallelLimitExceeded: (429, "parallel_limit"),
    RateLimitExceeded: (429, "rate_limit"),
    LimitExceeded: (429, "rate_limit"),
    BudgetExceeded: (429, "budget_exceeded"),
    AccountGone: (401, "invalid_api_key"),
    TeamBlocked: (401, "team_blocked"),
    ConversationNotFound: (404, "conversation_not_found"),
    MessageNotFound: (404, "message_not_found"),
    FileNotFound: (404, "file_not_found"),
    BatchNotFound: (404, "batch_not_found"),
    BatchConflict: (409, "batch_state"),
    ChatKeyBlocked: (403, "key_blocked"),
    DatabaseUnavailable: (503, "database_unavailable"),
    GatewayError: (400, None),
}


# error class -> the body's `type` where LiteLLM's proxy names it (else the status's: wire/errors.py)
LITELLM_TYPES: dict[type[GatewayError], str] = {BudgetExceeded: "budget_exceeded"}

log = logging.getLogger("treeserve.gateway")
HELD_RETRY_AFTER = 1  # seconds a request refused for what requests in flight hold of its budget is told to wait


def to_api_error(exc: GatewayError) -> APIError:
    status, code = next(HTTP_STATUS[cls] for cls in type(exc).__mro__ if cls in HTTP_STATUS)
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, (LimitExceeded, DatabaseUnavailable)) else None
    if isinstance(exc, BudgetExceeded):
        headers = _budget_headers(exc)
    if exc.request_id is not None:  # (a refused request's: its log line has it)
        headers = (headers or {}) | {"x-request-id": exc.request_id}
    error_type = next((LITELLM_TYPES[cls] for cls in type(exc).__mro__ if cls in LITELLM_TYPES), None)
    return APIError(status, exc.message, param=exc.param, code=code, headers=headers, error_type=error_type)


def _budget_headers(exc: BudgetExceeded) -> dict[str, str]:
    """A 429 `budget_exceeded` either way, as LiteLLM's proxy answers. A spent budget stays spent until
    an admin or its reset changes it: `x-should-retry: false` tells OpenAI's clients not to retry it
    (they retry a 429 twice otherwise). A budget only held by requests in flight (their worst cases)
    comes back, what they do not use, as they settle: try again in a second."""
    if exc.spent:
        return {"x-should-retry": "false"}
    return {"Retry-After": str(HELD_RETRY_AFTER)}


def install_domain_error_handlers(app: FastAPI) -> None:
    """Domain errors and ValueErrors (a ParamError names its parameter) as error bodies (OpenAI's,
    Anthropic's on its routes)."""

    @app.exception_handler(GatewayError)
    async def _refused(request: Request, exc: GatewayError):
        return _response(request, to_api_error(exc))

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError):
        return _response(request, from_value_error(exc))

    async def _database_error(request: Request, exc: Exception):
        if not database_down(exc):  # (a deadlock, a missing table: the gateway's fault, not an outage)
            log.error("%s %s: a database statement failed", request.method, logged_path(request), exc_info=exc)
            return _response(request, APIError(500, f"internal error: the database refused a statement "
                                                    f"({type(exc).__name__}); the gateway's log has it"))
        log.warning("%s %s: the database is unavailable (%s)", request.method, logged_path(request),
                    " ".join(str(exc).split())[:300])
        return _response(request, to_api_error(DatabaseUnavailable()))

    for error in DATABASE_ERRORS:  # (a storage call anywhere: a key's lookup, an admission, an admin route)
        app.add_exception_handler(error, _database_error)


def _response(request: Request, err: APIError):
    return error_response_for(request.url.path, err.status, err.message, err.param, err.code, err.headers,
                              err.error_type)
