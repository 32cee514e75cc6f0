"""The soak test's mixed load: client loops that pick a request kind at random until a deadline.

Every request ends as one `Outcome`: its kind, its HTTP status (or `conn_error` / `timeout` when
no status came back), how long it took, and `problem`, empty when the answer was what a client of
the OpenAI API would expect and otherwise a short description of what was wrong (the status is
still the one the server sent, so a 5xx with a wrong body is counted as a 5xx). Some streams are
cut off on purpose by closing the connection after a few events: the server must abort them
without leaking their KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import httpx

from treeserve.bench.sse_data import asse_data

OVERSIZED_BODY_BYTES = (2 << 20) + 4096  # just over the server's 2 MiB limit
ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class LoadConfig:
    base_url: str
    generator: str = "arith-gen"
    verifier: str = "arith-prm"
    stream_search_400_ok: bool = True  # a server without streamed search may refuse it with 400
    request_timeout: float = 180.0
    seed: int = 0


@dataclass
class Outcome:
    kind: str
    status: str
    seconds: float
    t: float
    problem: str = ""

    def as_json(self) -> dict:
        return asdict(self)


@dataclass
class Problem:
    """One question and a correct solution for it, one string per step."""
    question: str
    steps: list[str]


class Unexpected(Exception):
    """The answer had a status, but not the expected body."""


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Unexpected(what)


async def read_events(response: httpx.Response, stop_after: int | None) -> tuple[list[str], bool]:
    """SSE `data:` payloads, at most `stop_after` of them (None: all); True when cut off early."""
    events = []
    async for data in asse_data(response.aiter_text()):
        events.append(data)
        if stop_after is not None and len(events) >= stop_after:
            return events, True
    return events, False


def body_text(response: httpx.Response) -> str:
    return response.content.decode(errors="replace")[:200]


def check_error_body(response: httpx.Response) -> None:
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with a message."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise Unexpected(f"no OpenAI error body: {body_text(response)!r}") from None
    expect(isinstance(error, dict) and ERROR_FIELDS <= set(error) and bool(error.get("message")),
           f"error body lacks fields: {error!r}"[:200])


class Requests:
    """One method per request kind; each returns the HTTP status and raises `Unexpected`."""

    def __init__(self, client: httpx.AsyncClient, config: LoadConfig, rng: random.Random, problems: list[Problem]):
        self.client, self.config, self.rng, self.problems = client, config, rng, problems
        self.last_status: int | None = None  # of the latest response, kept even when its body was wrong
        hooks = client.event_hooks
        hooks.setdefault("response", []).append(self._saw_response)
        client.event_hooks = hooks

    async def _saw_response(self, response: httpx.Response) -> None:
        self.last_status = response.status_code

    def problem(self) -> Problem:
        return self.rng.choice(self.problems)

    async def status_or_error(self, response: httpx.Response, allowed: tuple[int, ...] = (200,)) -> int:
        if response.status_code != 200:
            await response.aread()
            expect(response.status_code in allowed, f"status {response.status_code}: {body_text(response)!r}")
            check_error_body(response)
        return response.status_code

    def chat_body(self, stream: bool) -> dict:
        return {"model": self.config.generator, "messages": [{"role": "user", "content": self.problem().question}],
                "max_tokens": self.rng.randint(4, 64), "temperature": 0.8, "stream": stream,
                "seed": self.rng.randrange(1 << 30)}

    async def chat(self) -> int:
        response = await self.client.post("/v1/chat/completions", json=self.chat_body(False))
        if await self.status_or_error(response) == 200:
            choice = response.json()["choices"][0]
            expect(choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length"),
                   f"odd chat choice: {choice!r}"[:200])
        return response.status_code

    async def chat_stream(self, cut_after: int | None = None) -> int:
        async with self.client.stream("POST", "/v1/chat/completions", json=self.chat_body(True)) as response:
            if await self.status_or_error(response) != 200:
                return response.status_code
            events, cut = await read_events(response, cut_after)
        if not cut:
            expect(events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-2:]!r}")
            chunks = [json.loads(e) for e in events[:-1]]
            expect(all(c.get("object") == "chat.completion.chunk" for c in chunks), "a chunk is not a chat chunk")
        return response.status_code

    async def chat_stream_cut(self) -> int:
        return await self.chat_stream(cut_after=self.rng.randint(1, 4))

    async def completion(self) -> int:
        body = {"model": self.config.generator, "prompt": self.problem().question,
                "max_tokens": self.rng.randint(4, 64), "temperature": 0.8, "seed": self.rng.randrange(1 << 30)}
        response = await self.client.post("/v1/completions", json=body)
        if await self.status_or_error(response) == 200:
            expect(isinstance(response.json()["choices"][0]["text"], str), "completion without text")
        return response.status_code

    def search_body(self, stream: bool) -> dict:
        return {"model": self.config.generator, "verifier": self.config.verifier, "question": self.problem().question,
                "strategy": "beam", "n": self.rng.choice((4, 8, 12, 16)), "beam_width": 4,
                "num_iterations": self.rng.randint(2, 5), "max_tokens": 64, "temperature": 0.8,
                "seed": self.rng.randrange(1 << 30), "stream": stream}

    async def search(self) -> int:
        response = await self.client.post("/v1/search", json=self.search_body(False))
        if await self.status_or_error(response) == 200:
            body = response.json()
            expect(body.get("object") == "search.result" and body.get("candidates"), f"odd search: {body!r}"[:200])
        return response.status_code

    async def search_stream(self, cut_after: int | None = None) -> int:
        allowed = (200, 400) if self.config.stream_search_400_ok else (200,)
        async with self.client.stream("POST", "/v1/search", json=self.search_body(True)) as response:
            if await self.status_or_error(response, allowed) != 200:
                return response.status_code
            kind = response.headers.get("content-type", "")
            if not kind.startswith("text/event-stream"):
                await response.aread()
                raise Unexpected(f"stream search answered {kind or 'no content-type'}, not SSE")
            events, cut = await read_events(response, cut_after)
        if not cut:
            expect(len(events) >= 2 and events[-1] == "[DONE]", f"search stream did not end with [DONE]: {events[-2:]!r}")
            final = json.loads(events[-2])
            expect(final.get("object") == "search.result", f"last search event is not the result: {final!r}"[:200])
        return response.status_code

    async def search_stream_cut(self) -> int:
        return await self.search_stream(cut_after=1)

    async def rewards(self) -> int:
        problem = self.problem()
        steps = problem.steps[:self.rng.randint(1, len(problem.steps))]
        response = await self.client.post("/v1/rewards", json={"model": self.config.verifier,
                                                              "question": problem.question, "steps": steps})
        if await self.status_or_error(response) == 200:
            scores = response.json().get("scores")
            expect(isinstance(scores, list) and len(scores) == len(steps), f"scores {scores!r} for {len(steps)} steps")
        return response.status_code

    async def bad_request(self) -> int:
        name, method, path, body, status = self.rng.choice(bad_cases(self.config))
        response = await self.client.request(method, path, content=body, headers={"Content-Type": "application/json"})
        expect(response.status_code == status, f"{name}: expected {status}, got {response.status_code}: "
                                               f"{body_text(response)!r}")
        check_error_body(response)
        return response.status_code


_OVERSIZED: bytes | None = None


def oversized_body() -> bytes:
    global _OVERSIZED
    if _OVERSIZED is None:
        _OVERSIZED = b'{"model": "x", "prompt": "' + b"a" * OVERSIZED_BODY_BYTES + b'"}'
    return _OVERSIZED


def bad_cases(config: LoadConfig) -> list[tuple[str, str, str, bytes | None, int]]:
    """(name, method, path, body, expected status): requests every server must refuse with a 4xx."""
    def chat(**changes):
        body = {"model": config.generator, "messages": [{"role": "user", "content": "1 + 1"}], "max_tokens": 4, **changes}
        return json.dumps(body).encode()

    return [("malformed json", "POST", "/v1/chat/completions", b'{"model": ', 400),
            ("wrong type", "POST", "/v1/chat/completions", chat(temperature="hot"), 400),
            ("messages not a list", "POST", "/v1/chat/completions", chat(messages="hi"), 400),
            ("unknown model", "POST", "/v1/chat/completions", chat(model="no-such-model"), 404),
            ("negative max_tokens", "POST", "/v1/chat/completions", chat(max_tokens=-3), 400),
            ("rewards without steps", "POST", "/v1/rewards",
             json.dumps({"model": config.verifier, "question": "q", "steps": []}).encode(), 400),
            ("oversized body", "POST", "/v1/completions", oversized_body(), 413),
            ("unknown route", "GET", "/v1/no-such-route", None, 404)]


KINDS = {  # kind -> weight in the mix
    "chat": 3, "chat_stream": 2, "chat_stream_cut": 2, "completion": 3, "search": 2, "search_stream": 1,
    "search_stream_cut": 1, "rewards": 3, "bad_request": 2,
}


async def timed(kind: str, requests: Requests, clock_start: float, timeout: float) -> Outcome:
    start = time.monotonic()
    status, problem = "", ""
    requests.last_status = None
    try:
        status = str(await asyncio.wait_for(getattr(requests, kind)(), timeout))
    except Unexpected as exc:
        status, problem = str(requests.last_status or "unexpected"), str(exc)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        status, problem = "timeout", f"no answer within {timeout:.0f} s"
    except httpx.TransportError as exc:
        status, problem = "conn_error", f"{type(exc).__name__}: {exc}"[:200]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:  # an unreadable answer
        status = str(requests.last_status or "unexpected")
        problem = f"unreadable answer: {type(exc).__name__}: {exc}"[:200]
    return Outcome(kind, status, time.monotonic() - start, start - clock_start, problem)


async def client_loop(index: int, config: LoadConfig, problems: list[Problem], clock_start: float,
                      deadline: float, outcomes: list[Outcome]) -> None:
    """Requests one after another until `deadline` (monotonic); the last one may run past it."""
    rng = random.Random(config.seed * 7919 + index)
    names, weights = list(KINDS), list(KINDS.values())
    async with httpx.AsyncClient(base_url=config.base_url, timeout=httpx.Timeout(config.request_timeout)) as client:
        requests = Requests(client, config, rng, problems)
        while time.monotonic() < deadline:
            kind = rng.choices(names, weights)[0]
            outcomes.append(await timed(kind, requests, clock_start, config.request_timeout))


async def run_load(config: LoadConfig, problems: list[Problem], clients: int, seconds: float,
                   clock_start: float) -> tuple[list[Outcome], bool]:
    """Every outcome, and whether all loops stopped by themselves (False: cut at the hard limit)."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + seconds
    tasks = [asyncio.create_task(client_loop(i, config, problems, clock_start, deadline, outcomes))
             for i in range(clients)]
    done, pending = await asyncio.wait(tasks, timeout=seconds + 2 * config.request_timeout + 30)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # a loop that failed by itself fails the run
    return outcomes, not pending
