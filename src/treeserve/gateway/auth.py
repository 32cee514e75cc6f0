"""Who is asking: the master key for the admin API, a client key for the OpenAI routes (from this
process's cache of recently checked keys, else the database). Both are FastAPI dependencies."""
from __future__ import annotations

import logging

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.accounts import Accounts
from treeserve.gateway.errors import TeamBlocked
from treeserve.gateway.key_cache import KeyCache
from treeserve.gateway.keys import MASTER_LABEL, KeyRecord, same_secret
from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.gateway")
MASTER = KeyRecord(None, MASTER_LABEL, MASTER_LABEL, None, None, None, None, None, None)  # type: ignore[arg-type]


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def logged_path(request: Request) -> str:
    """The path a log line names: the matched route's template (`/key/{key:path}/regenerate`), not
    the path sent, whose parameters may be a secret (a key to regenerate); the path itself where no
    route matched."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or request.url.path


def client_key(request: Request) -> str | None:
    """The key a client sent: `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`."""
    return bearer(request) or request.headers.get("x-api-key", "").strip() or None


class Auth:
    def __init__(self, master_key: str | None, accounts: Accounts, keys: KeyCache):
        self.master_key, self.accounts, self.keys = master_key, accounts, keys

    async def require_master(self, request: Request) -> None:
        """The master key, or a 401 (403: no master key configured); each call logged with whether it
        was let in (the method and the route, never the query or a path's parameters: keys go there)."""
        token = bearer(request)
        if not self.master_key:
            log.warning("admin %s %s refused: the admin API is off", request.method, logged_path(request))
            raise APIError(403, "the admin API is off: start the gateway with --master-key (or TREESERVE_MASTER_KEY)",
                           code="no_master_key")
        if token is None or not same_secret(token, self.master_key):
            log.warning("admin %s %s refused: %s", request.method, logged_path(request),
                        "no key" if token is None else "not the master key")
            raise APIError(401, "the admin API needs the master key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        log.info("admin %s %s", request.method, logged_path(request))

    async def require_key(self, request: Request) -> KeyRecord:
        """The key's record (MASTER for the master key); 401 for a missing, unknown, expired or blocked key."""
        token = client_key(request)
        if token is None:
            log.info("%s %s refused 401: no key", request.method, logged_path(request))
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                           code="invalid_api_key")
        if self.master_key and same_secret(token, self.master_key):
            return MASTER
        key = self.keys.get(token)
        if key is None or key.expired:
            # (a key of a blocked team: TeamBlocked, a 401 saying so, as LiteLLM's "Team=... is blocked")
            try:
                key = await self.keys.load(token, lambda: run_in_threadpool(self.accounts.authenticate, token, True))
            except TeamBlocked as exc:  # (logged as every other 401 of a key is)
                log.info("%s %s refused 401: a key of blocked team %r", request.method, logged_path(request),
                         exc.team_id)
                raise
            if key is None:
                log.info("%s %s refused 401: an unknown, expired or blocked key", request.method, logged_path(request))
                raise APIError(401, "invalid API key (unknown, expired or blocked)", code="invalid_api_key")
        return key
