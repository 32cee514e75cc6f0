"""The async HTTP client: one OpenAI request, timed chunk by chunk on the run's clock.

Streaming responses are read as server-sent events; every chunk that carries text is one
arrival. Output token counts come from the final `usage` (asked for with
`stream_options.include_usage`); a server that sends none gets its text chunks counted instead.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import aiohttp

from treeserve.bench.datasets import SampleRequest
from treeserve.errors import ParamError


class Clock:
    """Seconds since the run began (monotonic), shared by the request log and the telemetry."""

    def __init__(self):
        self.start_monotonic = time.perf_counter()
        self.start_unix = time.time()

    def now(self) -> float:
        return time.perf_counter() - self.start_monotonic

    def unix(self, t: float) -> float:
        return self.start_unix + t


@dataclass
class RequestRecord:
    index: int
    level: int
    warmup: bool
    start: float
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrivals of text-carrying chunks
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_counted: bool = False  # True: no usage came back, chunks were counted instead
    # speculative decoding: the request's draft tokens kept and rejected (usage.completion_tokens_details'
    # accepted_/rejected_prediction_tokens, where the server reports them)
    accepted_draft_tokens: int | None = None
    rejected_draft_tokens: int | None = None
    expected_output_tokens: int | None = None
    finish_reason: str | None = None
    success: bool = False
    status: int | None = None
    error: str = ""

    @property
    def first_token(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> "RequestRecord":
        return cls(**{k: v for k, v in row.items() if k in cls.__dataclass_fields__})


@dataclass
class Endpoint:
    base_url: str
    model: str
    kind: str = "completions"  # or "chat"
    stream: bool = True
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0

    @property
    def url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, sample: SampleRequest) -> dict:
        body = {"model": self.model, "max_tokens": sample.output_len, "temperature": self.temperature,
                "stream": self.stream, "ignore_eos": self.ignore_eos}
        if self.kind == "chat":
            if not isinstance(sample.prompt, str):
                raise ParamError("endpoint", "token-id prompts (the random dataset) need the completions endpoint")
            body["messages"] = [{"role": "user", "content": sample.prompt}]
        else:
            body["prompt"] = sample.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


class ClientPool:
    """One aiohttp session for the run, its connector unbounded: every request in flight gets a
    keep-alive connection of its own, and a finished request's connection serves the next.

    aiohttp parses responses in C; httpx's pure-Python stack cost about 3 ms a request here, so 64
    requests started together spread over 200 ms and the client's own delay showed up in TTFT."""

    def __init__(self, timeout: float = 600.0):
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None
        self.closing = False  # set as the run ends: a request failing from then on was cut short by it

    @contextlib.asynccontextmanager
    async def client(self):
        if self.session is None:
            raise RuntimeError("ClientPool is used inside `async with`")
        yield self.session

    async def __aenter__(self) -> "ClientPool":
        self.session = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc) -> None:
        self.closing = True
        await self.session.close()


async def send_request(pool: ClientPool, endpoint: Endpoint, sample: SampleRequest,
                       record: RequestRecord, clock: Clock) -> RequestRecord:
    record.expected_output_tokens = sample.output_len
    record.prompt_tokens = sample.prompt_len
    try:
        body = endpoint.payload(sample)
        async with pool.client() as client:
            record.start = clock.now()
            async with client.post(endpoint.url, json=body, headers=endpoint.headers()) as response:
                record.status = response.status
                if response.status != 200:
                    record.error = (await response.read()).decode(errors="replace")[:500]
                elif endpoint.stream:
                    await read_stream(response.content.iter_any(), record, clock)
                else:
                    read_whole(json.loads(await response.read()), record)
                record.end = clock.now()
        record.success = record.status == 200 and not record.error
    except Exception as exc:  # a failed request is a measurement, never a crash of the run
        if pool.closing:  # the run is ending (Ctrl-C) and closed the pool under it: cut short, not failed
            record.end = None
            return record
        record.end = clock.now()
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    return record


async def read_stream(pieces: AsyncIterator[bytes], record: RequestRecord, clock: Clock) -> None:
    """Splits server-sent events out of the raw bytes as they arrive, each piece timed on arrival.
    An error event (OpenAI's `{"error": ...}` or the `{"object": "error", ...}` of older vLLM), or a
    stream that ends with neither a finish_reason nor `[DONE]`, makes the request a failure."""
    usage, pending, done = None, b"", False
    async for piece in pieces:
        now = clock.now()
        events = (pending + piece).replace(b"\r\n", b"\n").split(b"\n\n")
        pending = events.pop()
        for event in events:
            data = event_data(event)
            done = done or data == b"[DONE]"
            if data is None or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("error") or chunk.get("object") == "error":
                record.error = json.dumps(chunk.get("error") or chunk)[:500]
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                if choice_text(choice):
                    record.chunk_times.append(now)
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
    done = done or event_data(pending.replace(b"\r\n", b"\n")) == b"[DONE]"  # (no blank line after it)
    if not done and record.finish_reason is None:
        record.error = "the stream ended early: no finish_reason and no [DONE]"
    apply_usage(record, usage, counted=len(record.chunk_times))


def event_data(event: bytes) -> bytes | None:
    """The payload of an SSE event's `data:` line(s), or None for comments and other fields."""
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def read_whole(body: dict, record: RequestRecord) -> None:
    choices = body.get("choices") or [{}]
    record.finish_reason = choices[0].get("finish_reason")
    apply_usage(record, body.get("usage"), counted=None)


def apply_usage(record: RequestRecord, usage: dict | None, counted: int | None) -> None:
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.output_tokens = usage.get("completion_tokens")
        details = usage.get("completion_tokens_details") or {}
        if details.get("accepted_prediction_tokens") is not None:
            record.accepted_draft_tokens = details["accepted_prediction_tokens"]
            record.rejected_draft_tokens = details.get("rejected_prediction_tokens") or 0
    if record.output_tokens is None and counted is not None:
        record.output_tokens, record.output_tokens_counted = counted, True
