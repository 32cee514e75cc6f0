"""Requests sent again with the same `Idempotency-Key` header are answered once: the first runs; a
repeat (same key, route and credentials) while it runs waits for its answer, and afterwards gets that
answer again without running anything (header `idempotent-replayed: true`), for `ttl` seconds and the
last `capacity` answers. Only whole 2xx answers are kept: an error or a stream runs again when
repeated. A search with the header runs to its end when its client leaves (server/serving_search.py),
so its repeat finds its answer. The gateway
sends one key per batch line, so a line whose gateway died while its request ran is answered from
here when the next gateway sends it again, not run twice."""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict

CAPACITY = 4096
TTL = 600.0  # seconds an answer is kept for a repeat


class IdempotentReplies:
    """The answers kept, and the requests running, by their key (hashed with route and credentials)."""

    def __init__(self, capacity: int = CAPACITY, ttl: float = TTL):
        self.capacity, self.ttl = capacity, ttl
        self.kept: OrderedDict[bytes, tuple[float, int, list, bytes]] = OrderedDict()
        self.running: dict[bytes, asyncio.Future] = {}
        self.completed = 0  # answers kept (each a request that ran to its end)
        self.replayed = 0   # repeats answered from them

    def keep(self, ident: bytes, status: int, headers: list, body: bytes) -> None:
        self.kept[ident] = (time.monotonic(), status, headers, body)
        self.completed += 1
        while len(self.kept) > self.capacity:
            self.kept.popitem(last=False)

    def answer(self, ident: bytes) -> tuple[int, list, bytes] | None:
        kept = self.kept.get(ident)
        if kept is None:
            return None
        if time.monotonic() - kept[0] > self.ttl:
            del self.kept[ident]
            return None
        self.replayed += 1
        return kept[1:]


class IdempotencyMiddleware:
    """A plain ASGI middleware (the request's receive channel is left alone)."""

    def __init__(self, app, replies: IdempotentReplies):
        self.app, self.replies = app, replies

    async def __call__(self, scope, receive, send):
        ident = _ident(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if ident is None:
            await self.app(scope, receive, send)
            return
        replies = self.replies
        while ident in replies.running:  # the same request is running: its answer is this one's too
            await asyncio.shield(replies.running[ident])
        kept = replies.answer(ident)
        if kept is not None:
            status, headers, body = kept
            await send({"type": "http.response.start", "status": status,
                        "headers": headers + [(b"idempotent-replayed", b"true")]})
            await send({"type": "http.response.body", "body": body})
            return
        replies.running[ident] = asyncio.get_running_loop().create_future()
        answer = _Answer(send)
        try:
            await self.app(scope, receive, answer.send)
        finally:
            if answer.keepable:
                replies.keep(ident, answer.status, answer.headers, b"".join(answer.body))
            replies.running.pop(ident).set_result(None)


class _Answer:
    """What the app sends, passed on and kept when it is a whole 2xx answer that is not a stream."""

    def __init__(self, send):
        self.downstream, self.status, self.headers, self.body = send, 0, [], []
        self.streamed, self.ended = False, False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", []))
            self.streamed = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in self.headers)
        elif message["type"] == "http.response.body" and not self.streamed:
            self.body.append(message.get("body", b""))
            self.ended = not message.get("more_body", False)
        await self.downstream(message)

    @property
    def keepable(self) -> bool:
        return 200 <= self.status < 300 and self.ended and not self.streamed


def _ident(scope) -> bytes | None:
    headers = dict(scope["headers"])
    key = headers.get(b"idempotency-key")
    if not key:
        return None
    who = headers.get(b"authorization", b"") + b"\0" + headers.get(b"x-api-key", b"")
    return hashlib.sha256(who + b"\0" + scope["path"].encode() + b"\0" + key).digest()
