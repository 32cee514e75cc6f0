"""The message-broker transport between the gateway and `treeserve worker`s (RabbitMQ, AMQP 0-9-1).

- Requests: one queue per model, `treeserve.model.<name>`, durable. A request is a JSON message
  `{"path": "/v1/chat/completions", "body": {...}}` with `correlation_id` (the gateway's request
  id), `reply_to` (the gateway's own exclusive reply queue), `expiration` (a request nobody took in
  time is dropped by the broker) and a `deadline_ms` header, milliseconds since the epoch as an
  integer (a worker that takes it later drops it). Not a float: AMQP tables carry floats in 32 bits,
  which hold a time of day in 2026 only to 128 s (a 60 s deadline could arrive already past).
- Workers take requests with manual acknowledgement and acknowledge once the request is answered:
  a worker that dies before that has its requests redelivered to another worker.
- Replies go to `reply_to` with the request's `correlation_id` and headers `kind` (`response`: a
  whole answer, `start`/`chunk`/`end`: a stream's status, raw SSE bytes, its end), `seq` (the
  message's number in its reply) and `worker` (who answered).
- Cancellations: the gateway publishes the request id to the fanout exchange `treeserve.cancel`;
  the worker holding that request stops it (its engine request is aborted).
"""
from __future__ import annotations

import json
import time

CANCEL_EXCHANGE = "treeserve.cancel"
# seconds a call to the broker (a declare, a publish, a consumer's cancel) may take before the broker
# counts as unreachable, on either side
BROKER_CALL_TIMEOUT = 5.0


def queue_name(model: str) -> str:
    return f"treeserve.model.{model}"


def encode_request(path: str, body: dict) -> bytes:
    return json.dumps({"path": path, "body": body}, separators=(",", ":")).encode()


def decode_request(raw: bytes) -> tuple[str, dict]:
    data = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("path"), str) or not isinstance(data.get("body"), dict):
        raise ValueError("a request message is {'path': str, 'body': object}")
    return data["path"], data["body"]


def request_headers(ttl: float) -> dict:
    """A request message's headers: its deadline, `ttl` seconds from now."""
    return {"deadline_ms": int((time.time() + ttl) * 1000)}


def expired(headers: dict | None) -> bool:
    """Whether a request's deadline has passed (a request without one never expires here)."""
    deadline = (headers or {}).get("deadline_ms")
    return isinstance(deadline, int) and not isinstance(deadline, bool) and time.time() * 1000 > deadline
