"""A mock OpenAI streaming server with known latency, for calibrating the benchmark client.

Every completion streams `max_tokens` one-token chunks: the first `ttft_ms` after the request's
body has arrived, then one every `itl_ms`, each on an absolute schedule so that jitter never
accumulates. The standard library only (asyncio), so it starts in a fraction of a second and
adds little of its own; run it as a script:

    python mock_server.py --port 8100 --ttft-ms 100 --itl-ms 10 [--exit-after 5]

`--exit-after N` makes the process die abruptly when request N+1 arrives (for testing sweeps).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

MODEL = "mock"


class MockServer:
    def __init__(self, ttft_s: float, itl_s: float, exit_after: int | None = None):
        self.ttft_s, self.itl_s, self.exit_after = ttft_s, itl_s, exit_after
        self.requests = self.generated = self.running = self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, headers = parse_head(head)
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self.route(method, path, body, writer)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: bytes, writer) -> None:
        if method == "GET" and path == "/health":
            await respond(writer, 200, b"", "text/plain")
        elif method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            await respond(writer, 200, json.dumps(models).encode())
        elif method == "GET" and path == "/metrics":
            await respond(writer, 200, self.metrics().encode(), "text/plain; version=0.0.4")
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self.complete(json.loads(body or b"{}"), path.endswith("chat/completions"), writer)
        else:
            await respond(writer, 404, b'{"error": {"message": "not found"}}')

    def metrics(self) -> str:
        return (f"# TYPE mock:request_success_total counter\nmock:request_success_total {self.requests}\n"
                f"# TYPE mock:generation_tokens_total counter\nmock:generation_tokens_total {self.generated}\n"
                f"# TYPE mock:num_requests_running gauge\nmock:num_requests_running {self.running}\n"
                f"# TYPE mock:connections_total counter\nmock:connections_total {self.connections}\n")

    async def complete(self, request: dict, chat: bool, writer) -> None:
        if self.exit_after is not None and self.requests >= self.exit_after:
            os._exit(3)  # die the way a crashed server does: no goodbye
        loop = asyncio.get_running_loop()
        began, tokens = loop.time(), int(request.get("max_tokens") or 16)
        prompt_tokens = len(request["prompt"]) if isinstance(request.get("prompt"), list) else 8
        self.running += 1
        try:
            if request.get("stream"):
                await self.stream(writer, began, tokens, prompt_tokens, chat)
            else:
                await asyncio.sleep(max(0.0, began + self.ttft_s + (tokens - 1) * self.itl_s - loop.time()))
                await respond(writer, 200, json.dumps(whole_body(tokens, prompt_tokens, chat)).encode())
        finally:
            self.running -= 1
            self.requests += 1
            self.generated += tokens

    async def stream(self, writer, began: float, tokens: int, prompt_tokens: int, chat: bool) -> None:
        loop = asyncio.get_running_loop()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for k in range(tokens):
            await asyncio.sleep(max(0.0, began + self.ttft_s + k * self.itl_s - loop.time()))
            finish = "length" if k == tokens - 1 else None
            write_event(writer, token_chunk(k, finish, chat))
            await writer.drain()
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        write_event(writer, {"choices": [], "usage": usage})
        writer.write(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


def parse_head(head: bytes) -> tuple[str, str, dict]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    return method, path.split("?", 1)[0], headers


async def respond(writer, status: int, body: bytes, content_type: str = "application/json") -> None:
    reason = {200: "OK", 404: "Not Found"}.get(status, "Error")
    writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
                 f"content-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def write_event(writer, payload: dict) -> None:
    writer.write(chunked(f"data: {json.dumps(payload)}\n\n".encode()))


def token_chunk(k: int, finish: str | None, chat: bool) -> dict:
    text = f" t{k}"
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"object": "chat.completion.chunk" if chat else "text_completion", "model": MODEL,
            "choices": [{**choice, "finish_reason": finish}]}


def whole_body(tokens: int, prompt_tokens: int, chat: bool) -> dict:
    text = "".join(f" t{k}" for k in range(tokens))
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
    return {"model": MODEL, "choices": [{**choice, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                      "total_tokens": prompt_tokens + tokens}}


async def serve(host: str, port: int, server: MockServer) -> None:
    listener = await asyncio.start_server(server.handle, host, port, backlog=1024)
    print(f"mock server on http://{host}:{port}", flush=True)
    async with listener:
        await listener.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--exit-after", type=int, help="die when request EXIT_AFTER + 1 arrives")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.host, args.port, MockServer(args.ttft_ms / 1000, args.itl_ms / 1000, args.exit_after)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
