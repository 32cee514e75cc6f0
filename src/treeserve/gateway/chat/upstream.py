"""Reading the gateway's own answers from inside the gateway: the chat sends its requests through
the same admission, routing and settlement as any client (`dispatch`), and reads what comes back."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from treeserve.gateway.sse import SSESplitter


class UpstreamError(Exception):
    """A model request failed; the message is the backend's or the gateway's own, `code` (OpenAI's
    error codes: `context_length_exceeded`) what the page may act on."""

    def __init__(self, message: str, code: str | None = None, status: int = 502):
        super().__init__(message)
        self.code, self.status = code, status  # (`status`: the refusal's HTTP status, 502 for a failure in a stream)


def error_message(content: bytes | str, status: int) -> str:
    """What the chat's user is told: the error's message, but not which backends failed how (their
    addresses are the operator's: the gateway's log has them)."""
    try:
        error = json.loads(content)["error"]
        if error.get("code") == "no_backend_available":
            return "the model is not available right now (no backend could answer); try again in a moment"
        return str(error.get("message") or error)
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"HTTP {status}"


def error_code(content: bytes | str) -> str | None:
    """The error's OpenAI code (`context_length_exceeded`, `budget_exceeded`, ...), if it has one."""
    try:
        code = json.loads(content)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if isinstance(code, str) else None


async def stream_events(response: Response) -> AsyncIterator[dict]:
    """The JSON events of a streamed answer until [DONE]; an error answer, or an error event in the
    stream, raises UpstreamError. Closing this iterator closes the upstream request (and settles it)."""
    if not isinstance(response, StreamingResponse):
        raise UpstreamError(error_message(response.body, response.status_code), error_code(response.body),
                            response.status_code)
    splitter = SSESplitter()
    try:
        async for piece in response.body_iterator:
            for payload in splitter.feed(piece if isinstance(piece, bytes) else piece.encode()):
                if payload == b"[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    raise UpstreamError(error_message(payload, 502))
                yield event
    finally:
        await response.body_iterator.aclose()
