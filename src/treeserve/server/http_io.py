"""What every server route shares at the HTTP edge: the API key check (every route but the health
probes). Bodies are read and parsed by wire/bodies.py."""
from __future__ import annotations

import hmac

from treeserve.wire.errors import error_response_for

MAX_BODY_BYTES = 2 << 20
OPEN_PATHS = {"/health", "/health/ready", "/ping"}  # the probes a load balancer sends (/ping: SageMaker's)


def keys_match(presented: str, keys: list[str]) -> bool:
    """Constant-time comparison against every configured key."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched


class APIKeyMiddleware:
    """Every route but the probes (/health, /health/ready, /ping) needs `Authorization: Bearer KEY` (or
    Anthropic's `x-api-key: KEY`). A plain ASGI middleware: it leaves
    the request's receive channel alone, so handlers see a client's disconnect."""

    def __init__(self, app, keys: list[str]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorised(scope):
            response = error_response_for(scope["path"], 401, "missing or invalid API key (send "
                                          "'Authorization: Bearer KEY', or 'x-api-key: KEY')", code="invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer":
            return keys_match(token.strip(), self.keys)
        key = headers.get(b"x-api-key", b"").decode("latin-1").strip()  # Anthropic's clients send this
        return bool(key) and keys_match(key, self.keys)
