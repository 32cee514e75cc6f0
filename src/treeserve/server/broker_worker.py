"""`treeserve worker`: a model server that takes its requests from a message broker (RabbitMQ)
instead of HTTP clients, so that engines scale out behind the gateway by starting more workers.

The worker runs the same app as `treeserve serve` on a loopback port (every route, limit and
error the same), and a consumer thread that takes each request message of its models' queues,
forwards it there, and publishes the answer (or each piece of the stream) to the message's
`reply_to`. A message is acknowledged once its request is answered (protocol:
gateway/broker_protocol.py): a worker that dies first has it redelivered to another worker."""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid

import aiohttp
import aio_pika

from treeserve.gateway.broker_protocol import CANCEL_EXCHANGE, decode_request, expired, queue_name

log = logging.getLogger("treeserve.worker")


class BrokerWorker:
    def __init__(self, broker_url: str, local_url: str, models: list[str], prefetch: int = 64,
                 api_key: str | None = None):
        self.broker_url, self.local_url, self.models = broker_url, local_url, models
        self.prefetch, self.api_key = prefetch, api_key
        self.worker_id = f"{uuid.uuid4().hex[:12]}"
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[str, set[asyncio.Task]] = {}  # by correlation id
        self._stopping = False

    # ---- lifecycle (called from other threads) ------------------------------------------------
    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._main, name="treeserve-broker", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported to the main thread, which stops the worker
            self.error = exc
            log.exception("the broker consumer failed")
            self.ready.set()

    # ---- consuming --------------------------------------------------------------------------
    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as http, \
                await aio_pika.connect_robust(self.broker_url) as connection:
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
            await self._stop.wait()
            # stopping: take nothing more, give what is in hand back to the queue for another worker
            self._stopping = True
            for queue, tag in consumers:
                await queue.cancel(tag)
            tasks = [t for group in self._running.values() for t in group]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
            elif self._stopping:  # a stream under way cannot start over elsewhere: the gateway cuts it
                await replies.send("response", _error_body(503, "the worker stopped"), status=503)
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
