"""The gateway's broker client when RabbitMQ dies (issue #40's chaos run found the fault): the
requests waiting for replies fail at once with BrokerLost (a stream ends with its error event, a
whole request goes to another backend) instead of waiting out their timeout, new requests and
health checks fail at once while it is down, and after RabbitMQ is back the client's new reply
queue gets the next answers. A real node, killed with SIGKILL."""
from __future__ import annotations

import asyncio
import signal
import time

import aio_pika
import pytest

from gateway_support import rabbit_node
from treeserve.gateway.broker import BrokerClient, BrokerLost, BrokerStream
from treeserve.wire.broker_protocol import expired, queue_name, request_headers

TIMEOUT = 60  # the backend's timeout: what a request waited before the fix


@pytest.fixture
def node():
    with rabbit_node() as node:
        yield node


async def _fake_worker(url: str, held: list):
    """Consumes model "m": a "stream" request gets a start and one chunk, then nothing more; a
    "hold" request nothing at all; any other one a whole answer."""
    connection = await aio_pika.connect_robust(url)
    channel = await connection.channel()
    queue = await channel.declare_queue(queue_name("m"), durable=True)

    async def reply(message, kind: str, body: bytes = b"", status: int | None = None) -> None:
        headers = {"kind": kind, "worker": "w1", **({"status": status} if status else {})}
        await channel.default_exchange.publish(
            aio_pika.Message(body, correlation_id=message.correlation_id, headers=headers),
            routing_key=message.reply_to)

    async def on_message(message) -> None:
        await message.ack()
        held.append(message.correlation_id)
        if message.correlation_id.startswith("stream"):
            await reply(message, "start", status=200)
            await reply(message, "chunk", b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        elif not message.correlation_id.startswith("hold"):
            await reply(message, "response", b'{"ok": true}', status=200)

    await queue.consume(on_message)
    return connection


async def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def test_a_dead_broker_fails_the_waiting_requests_at_once_and_a_restarted_one_serves(node):
    async def scenario():
        held: list[str] = []
        worker = await _fake_worker(node.url, held)
        client = BrokerClient(node.url)
        await client.start()
        try:
            stream = BrokerStream(client, "stream-1", await client.request("m", "/v1/x", {}, "stream-1", TIMEOUT),
                                  TIMEOUT)
            assert (await stream.first()).kind == "stream"
            whole = BrokerStream(client, "hold-1", await client.request("m", "/v1/x", {}, "hold-1", TIMEOUT), TIMEOUT)
            await _wait(lambda: "hold-1" in held, 10)
            killed = time.monotonic()
            node.stop(signal.SIGKILL)
            with pytest.raises(BrokerLost):
                async for _ in stream.batches():
                    pass
            with pytest.raises(BrokerLost):
                await whole.first()
            assert time.monotonic() - killed < 5, "the requests waited for their timeout"
            assert not client.pending
            # while it is down, a new request fails at once (the gateway's retry then answers 503) and the
            # health check says so, instead of both waiting for the reconnection
            await _wait(lambda: not client.connection.connected.is_set(), 10)
            started = time.monotonic()
            with pytest.raises(BrokerLost):  # (a TimeoutError here: it waited)
                await asyncio.wait_for(client.request("m", "/v1/x", {}, "during-outage", TIMEOUT), 10)
            with pytest.raises(BrokerLost):
                await asyncio.wait_for(client.queue_state("m"), 10)
            await asyncio.wait_for(client.cancel("during-outage"), 10)  # (nothing to tell: it returns)
            assert time.monotonic() - started < 1 and not client.pending

            await asyncio.to_thread(node.start)
            await _wait(lambda: client.connection.connected.is_set() and worker.connected.is_set(), 60)
            deadline = time.monotonic() + 30
            while True:  # (the consumers come back a moment after the connection)
                try:
                    replies = await client.request("m", "/v1/x", {}, "after-restart", TIMEOUT)
                    break
                except Exception:  # no consumer yet, or the channel not restored yet
                    assert time.monotonic() < deadline, "no consumer came back"
                    await asyncio.sleep(0.2)
            answer = await BrokerStream(client, "after-restart", replies, 10).first()
            assert (answer.kind, answer.status, answer.body) == ("response", 200, b'{"ok": true}')
        finally:
            await client.close()
            await worker.close()

    asyncio.run(scenario())


def test_a_worker_stops_on_its_signal_while_the_broker_is_down(node, llama_dir):
    """SIGTERM to an idle `treeserve worker` whose broker was killed: it exits 0 within its grace,
    instead of waiting for the broker to come back to say it consumes no more."""
    import subprocess

    from gateway_support import workers

    with workers(llama_dir, 1, node.url, "sk-worker") as (proc,):
        node.stop(signal.SIGKILL)
        time.sleep(1)  # (the worker sees its connection close)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the worker was still running 30 s after SIGTERM") from None
        assert code == 0, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() - started < 15


def test_a_request_deadline_crosses_the_wire_to_the_millisecond(monkeypatch):
    """The headers as AMQP carries them (pamqp's field table, what aio_pika sends and reads): a
    deadline sent as a float arrived as a 32-bit float, off by up to 64 s, and a request published
    at a time of day like this one's (3 s past a multiple of 128 s) with 60 s to live arrived
    already past: the worker dropped it unanswered, and the gateway waited out its whole timeout."""
    from pamqp import decode, encode

    start = 14_031_200 * 128 + 3.0
    monkeypatch.setattr(time, "time", lambda: start)
    _, received = decode.field_table(encode.field_table(request_headers(60)))
    assert not expired(received)
    monkeypatch.setattr(time, "time", lambda: start + 59.99)
    assert not expired(received)
    monkeypatch.setattr(time, "time", lambda: start + 60.01)
    assert expired(received)
    assert not expired({}) and not expired(None)
