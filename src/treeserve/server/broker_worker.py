"""`treeserve worker`: a model server that takes its requests from a message broker (RabbitMQ)
instead of HTTP clients, so that engines scale out behind the gateway by starting more workers.

The worker runs the same app as `treeserve serve` on a loopback port (every route, limit and
error the same), and a consumer thread that takes each request message of its models' queues,
forwards it there, and publishes the answer (or each piece of the stream) to the message's
`reply_to`. A message is acknowledged once its request is answered (protocol:
wire/broker_protocol.py): a worker that dies first has it redelivered to another worker."""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid

import aiohttp
import aio_pika

from treeserve.wire.broker_protocol import BROKER_CALL_TIMEOUT, CANCEL_EXCHANGE, decode_request, expired, queue_name

log = logging.getLogger("treeserve.worker")


class BrokerWorker:
    def __init__(self, broker_url: str, local_url: str, models: list[str], prefetch: int = 64,
                 api_key: str | None = None):
        self.broker_url, self.local_url, self.models = broker_url, local_url, models
        self.prefetch, self.api_key = prefetch, api_key
        self.worker_id = f"{uuid.uuid4().hex[:12]}"
        self.ready = threading.Event()
        self.finished = threading.Event()  # the consumer has stopped (drained, failed or never started)
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._now: asyncio.Event | None = None  # stop without waiting for the requests in hand
        self._grace: float | None = None  # set by `stop`: seconds the requests in hand may take
        self._given_back = 0  # requests in hand at the end of the grace, returned to the queue
        self._streams_cut = 0  # and answers under way then, ended with an error
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[str, set[asyncio.Task]] = {}  # by correlation id
        self._stopping = False
        self._lost: set[asyncio.Task] = set()  # requests stopped because the broker connection closed

    # ---- lifecycle (called from other threads) ------------------------------------------------
    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._main, name="treeserve-broker", daemon=True)
        thread.start()
        return thread

    def stop(self, grace: float = 0.0) -> bool:
        """Takes nothing more from the queues and lets the requests in hand finish for up to
        `grace` seconds (a later call may shorten that to none). False if stopping already."""
        first = self._grace is None
        self._grace = grace if first else min(grace, self._grace)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)
        return first

    def _wake(self) -> None:
        self._stop.set()
        if self._grace == 0:
            self._now.set()

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported to the main thread, which stops the worker
            self.error = exc
            # a broker not reached (aiormq's AMQPConnectionError, a ConnectionError, wraps the socket's OSError):
            # the reason in one line; any other OSError (a certificate file missing, ...) with its traceback
            if isinstance(exc, ConnectionError):
                log.error("the broker consumer failed: %s", exc)
            else:
                log.exception("the broker consumer failed")
            self.ready.set()
        finally:
            self.finished.set()

    # ---- consuming --------------------------------------------------------------------------
    async def _run(self) -> None:
        self._stop, self._now = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as http, \
                await aio_pika.connect_robust(self.broker_url) as connection:
            connection.close_callbacks.add(self._on_connection_closed)
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=self.prefetch)
            cancels = await channel.declare_exchange(CANCEL_EXCHANGE, aio_pika.ExchangeType.FANOUT)
            cancel_queue = await channel.declare_queue(exclusive=True, auto_delete=True)
            await cancel_queue.bind(cancels)
            await cancel_queue.consume(self._on_cancel, no_ack=True)
            consumers = []
            for model in self.models:
                queue = await channel.declare_queue(queue_name(model), durable=True)
                consumers.append((queue, await queue.consume(lambda message: self._take(message, http, channel))))
            log.info("worker %s consuming %s", self.worker_id, ", ".join(queue_name(m) for m in self.models))
            self.ready.set()
            if self._grace is not None:  # stopped before the loop was there to hear it
                self._wake()
            await self._stop.wait()
            await self._stop_consuming(connection, consumers)
            await self._finish_in_hand()
            # what is still in hand goes back to the queue for another worker (a stream under way is cut)
            self._stopping = True
            tasks = self._tasks()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if tasks:
                log.info("worker %s: %d request(s) given back to the queue, %d stream(s) under way ended with "
                         "an error", self.worker_id, self._given_back, self._streams_cut)

    async def _stop_consuming(self, connection, consumers) -> None:
        """Takes nothing more: the queues' next messages go to other workers. With the broker down
        (the connection reconnecting) there is nothing to tell it, and waiting for it would hold the
        worker past its signal: its deliveries end with the connection anyway."""
        for queue, tag in consumers:
            if not connection.connected.is_set():
                return
            try:
                await asyncio.wait_for(queue.cancel(tag), BROKER_CALL_TIMEOUT)
            except (asyncio.TimeoutError, aio_pika.exceptions.AMQPError, RuntimeError) as exc:
                log.warning("worker %s: could not stop consuming %s (%s)", self.worker_id, queue.name, exc)
                return

    def _tasks(self) -> list[asyncio.Task]:
        return [t for group in self._running.values() for t in group]

    async def _finish_in_hand(self) -> None:
        """Waits for the requests in hand, for up to the grace `stop` gave, or until stopped now."""
        deadline = self._loop.time() + (self._grace or 0.0)
        now = asyncio.ensure_future(self._now.wait())
        if self._tasks():
            log.info("worker %s: draining %d request(s) in hand", self.worker_id, len(self._tasks()))
        try:
            while self._tasks() and not self._now.is_set() and self._loop.time() < deadline:
                await asyncio.wait([*self._tasks(), now], timeout=deadline - self._loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            now.cancel()

    async def _take(self, message: aio_pika.abc.AbstractIncomingMessage, http, channel) -> None:
        key = message.correlation_id or ""
        task = asyncio.create_task(self._answer(message, http, channel))
        self._running.setdefault(key, set()).add(task)

        def forget(_: asyncio.Task) -> None:
            group = self._running.get(key)
            if group is not None:
                group.discard(task)
                if not group:
                    del self._running[key]
        task.add_done_callback(forget)

    def _on_connection_closed(self, _connection, exc: BaseException | None = None) -> None:
        """The requests in hand are stopped: their replies cannot be sent, and the broker gives
        them again (to this worker once it is back, or another) if it still holds them."""
        if self._stopping or not self._tasks():
            return
        log.warning("worker %s: the broker connection closed (%s): stopping %d request(s) in hand",
                    self.worker_id, exc or "closed", len(self._tasks()))
        for task in self._tasks():
            self._lost.add(task)
            task.cancel()

    async def _on_cancel(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        for task in list(self._running.get(message.body.decode(errors="replace"), ())):
            task.cancel()

    async def _answer(self, message, http: aiohttp.ClientSession, channel) -> None:
        replies = Replies(channel, message, self.worker_id)
        requeued = False
        try:
            if not message.reply_to:
                log.warning("request %s has no reply_to: dropped", message.correlation_id)
                return
            if expired(message.headers):
                log.info("request %s expired before it was taken: dropped", message.correlation_id)
                return
            if message.redelivered:
                log.info("request %s redelivered: the worker that took it first did not answer it",
                         message.correlation_id)
            try:
                path, body = decode_request(message.body)
            except ValueError as exc:
                await replies.send("response", _error_body(400, f"bad request message: {exc}"), status=400)
                return
            async with http.post(self.local_url + path, json=body) as response:
                if body.get("stream") and response.status == 200:
                    await replies.send("start", b"", status=200)
                    async for piece in response.content.iter_any():
                        await replies.send("chunk", piece)
                    await replies.send("end", b"")
                else:
                    await replies.send("response", await response.read(), status=response.status)
        except asyncio.CancelledError:
            if self._stopping and not replies.seq:  # untouched: back to the queue for another worker
                await message.reject(requeue=True)
                requeued = True
                self._given_back += 1
            elif self._stopping:  # a stream under way cannot start over elsewhere: the gateway cuts it
                await replies.send("response", _error_body(503, "the worker stopped"), status=503)
                self._streams_cut += 1
            elif asyncio.current_task() in self._lost:
                self._lost.discard(asyncio.current_task())
                requeued = True  # (its channel is gone: nothing to acknowledge on)
            else:
                log.info("request %s cancelled by the gateway", message.correlation_id)
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("request %s failed on the local server: %s", message.correlation_id, exc)
            await replies.send("response", _error_body(503, f"the worker's server failed: {exc}"), status=503)
        finally:
            if not requeued:
                await message.ack()


class Replies:
    """The messages of one request's reply, numbered."""

    def __init__(self, channel, message, worker_id: str):
        self.channel, self.message, self.worker_id, self.seq = channel, message, worker_id, 0

    async def send(self, kind: str, body: bytes, status: int | None = None) -> None:
        headers = {"kind": kind, "seq": self.seq, "worker": self.worker_id}
        if status is not None:
            headers["status"] = status
        self.seq += 1
        await self.channel.default_exchange.publish(
            aio_pika.Message(body, correlation_id=self.message.correlation_id, headers=headers),
            routing_key=self.message.reply_to)


def _error_body(status: int, message: str) -> bytes:
    import json

    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
