"""The gateway's side of the broker transport (protocol: broker_protocol.py): publish a request to
its model's queue, receive its reply on this process's own reply queue, cancel it."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aio_pika

from treeserve.wire.broker_protocol import (BROKER_CALL_TIMEOUT, CANCEL_EXCHANGE, encode_request, queue_name,
                                            request_headers)
from treeserve.gateway.config import url_without_userinfo
from treeserve.gateway.sse import SSESplitter

log = logging.getLogger("treeserve.gateway")
CONSUMER_CHECK_INTERVAL = 1.0  # seconds a queue's last seen consumer is trusted


class NoWorkers(ConnectionError):
    """Nobody consumes the model's queue: a request there would only wait out its timeout."""


class BrokerLost(ConnectionError):
    """The connection to the broker closed: this process's reply queue, and every reply on its way
    to it, went with it."""


class BrokerClient:
    def __init__(self, url: str):
        self.url = url
        self.connection = self.channel = self.reply_queue = self.cancels = None
        self.pending: dict[str, asyncio.Queue] = {}
        self._consumers_seen: dict[str, float] = {}  # queue -> when it last had a consumer

    async def start(self) -> None:
        self.connection = await aio_pika.connect_robust(self.url)
        self.connection.close_callbacks.add(self._on_connection_closed)
        self.channel = await self.connection.channel()
        self.cancels = await self.channel.declare_exchange(CANCEL_EXCHANGE, aio_pika.ExchangeType.FANOUT)
        self.reply_queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
        await self.reply_queue.consume(self._on_reply, no_ack=True)

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()

    async def request(self, model: str, path: str, body: dict, request_id: str, ttl: float) -> asyncio.Queue:
        """Publishes the request; its reply messages arrive on the returned queue, in order."""
        queue = queue_name(model)
        if time.monotonic() - self._consumers_seen.get(queue, -CONSUMER_CHECK_INTERVAL) >= CONSUMER_CHECK_INTERVAL:
            declared = await self._call(lambda: self.channel.declare_queue(queue, durable=True))
            if not declared.declaration_result.consumer_count:
                raise NoWorkers(f"no worker consumes {queue}")  # fail now rather than wait out the timeout
            self._consumers_seen[queue] = time.monotonic()
        message = aio_pika.Message(encode_request(path, body), correlation_id=request_id,
                                   reply_to=self.reply_queue.name, expiration=ttl,
                                   headers=request_headers(ttl))
        replies: asyncio.Queue = asyncio.Queue()
        self.pending[request_id] = replies
        try:
            await self._call(lambda: self.channel.default_exchange.publish(message, routing_key=queue))
        except BaseException:
            self.done(request_id)
            raise
        return replies

    async def queue_state(self, model: str) -> tuple[int, int]:
        """(messages waiting, consumers) of the model's queue."""
        declared = await self._call(lambda: self.channel.declare_queue(queue_name(model), durable=True))
        return declared.declaration_result.message_count, declared.declaration_result.consumer_count

    def done(self, request_id: str) -> None:
        """Forgets the request: replies that still come (a redelivered duplicate) are dropped."""
        self.pending.pop(request_id, None)

    async def cancel(self, request_id: str) -> None:
        """Forgets the request and tells the workers to stop it. With the broker unreachable nothing
        reaches them: a request still queued expires with its TTL."""
        self.done(request_id)
        try:
            await self._call(lambda: self.cancels.publish(aio_pika.Message(request_id.encode()), routing_key=""))
        except BrokerLost as exc:
            log.info("broker %s: request %s not cancelled: %s", url_without_userinfo(self.url), request_id, exc)

    async def _call(self, call):
        """`call()`'s result; BrokerLost at once while the connection is down (it is reconnecting:
        a call would wait until it is back), or when the broker takes BROKER_CALL_TIMEOUT to answer."""
        if self.connection is None or not self.connection.connected.is_set():
            raise BrokerLost("the broker is unreachable (its connection is down and reconnecting)")
        try:
            return await asyncio.wait_for(call(), BROKER_CALL_TIMEOUT)
        except asyncio.TimeoutError:
            raise BrokerLost(f"the broker did not answer in {BROKER_CALL_TIMEOUT:g} s") from None

    def _on_connection_closed(self, _connection, exc: BaseException | None = None) -> None:
        """Every request waiting for a reply fails now (a stream ends with its error event, a whole
        request goes to another backend) instead of waiting out its timeout: their replies are lost."""
        if not self.pending:
            return
        log.warning("broker %s: connection closed (%s): failing %d request(s) waiting for replies",
                    url_without_userinfo(self.url), exc or "closed", len(self.pending))
        pending, self.pending = self.pending, {}
        self._consumers_seen.clear()
        for replies in pending.values():
            replies.put_nowait(BrokerLost(f"the connection to the broker closed ({exc or 'closed'})"))

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        replies = self.pending.get(message.correlation_id or "")
        if replies is not None:
            replies.put_nowait(message)


class WorkerGone(ConnectionError):
    """The worker streaming an answer stopped mid-way (its request went to another worker)."""


@dataclass
class FirstReply:
    kind: str                  # "response" (a whole answer) or "stream"
    status: int
    body: bytes = b""
    events: list[bytes] = field(default_factory=list)  # a stream's first events


class BrokerStream:
    """One request's reply, read message by message. A stream belongs to the worker that started
    it; a message from another worker means the first one died and the broker redelivered the
    request: before the first event that is a fresh start, after it the stream is cut (never
    replayed to a client that already has part of it)."""

    def __init__(self, client: BrokerClient, request_id: str, replies: asyncio.Queue, timeout: float):
        self.client, self.request_id, self.replies, self.timeout = client, request_id, replies, timeout
        self.owner: str | None = None
        self.splitter = SSESplitter()
        self.finished = False

    async def first(self) -> FirstReply:
        while True:
            message = await self._next()
            kind, worker = message.headers.get("kind"), message.headers.get("worker")
            if kind == "response":
                self.finished = True
                return FirstReply("response", int(message.headers.get("status") or 502), message.body)
            if kind == "start" or worker != self.owner:
                self.owner, self.splitter = worker, SSESplitter()
            if kind == "chunk":
                events = self.splitter.feed(message.body)
                if events:
                    return FirstReply("stream", 200, events=events)
            elif kind == "end":
                self.finished = True
                return FirstReply("stream", 200, events=self.splitter.finish())

    async def batches(self) -> AsyncIterator[list[bytes]]:
        while not self.finished:
            message = await self._next()
            kind, worker = message.headers.get("kind"), message.headers.get("worker")
            if worker != self.owner or kind not in ("chunk", "end"):
                raise WorkerGone(f"the worker streaming this answer stopped ({kind!r} from another worker)")
            events = self.splitter.feed(message.body) if kind == "chunk" else self.splitter.finish()
            self.finished = kind == "end"
            if events:
                yield events

    async def close(self) -> None:
        if self.finished:
            self.client.done(self.request_id)
        else:  # the client left, or the stream was cut: the worker stops generating
            await self.client.cancel(self.request_id)

    def cut(self, exc: BaseException) -> None:
        """The next read raises `exc`."""
        self.replies.put_nowait(exc)

    async def _next(self):
        message = await asyncio.wait_for(self.replies.get(), self.timeout)
        if isinstance(message, BaseException):
            raise message
        return message
