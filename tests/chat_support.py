"""What the web chat's tests run against: the bundled arith-gen + arith-prm + arith-router served by
a real treeserve server as `treeserve chat` serves them (hermes tool-call parser; with a tap that
records every request body it receives), the gateway with its chat page in front, and loopback
stand-ins for what no bundled model or offline machine has:

- `scripted`: an OpenAI-compatible server standing in for a function-calling router model that
  knows the weather and Wikipedia tools too (the gateway's own tests route with it; the bundled
  arith-router is what `router="arith-router"` and `treeserve chat` use). Given tools, it streams a
  call the way OpenAI and vLLM do (the name in the first delta, then the arguments): `sympy` for a
  message with maths in it, else `answer_directly`. Without tools it streams the last user message
  back ("echo"), which lets the XSS test make a model answer whatever markup it needs.
- weather and Wikipedia HTTP services (the issue asks for stub servers on loopback).
Every request they receive is recorded."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from conftest import running_server
from treeserve.gateway.app import build_app as build_gateway
from treeserve.gateway.config import BackendConfig, ChatConfig, GatewayConfig, ModelConfig
from treeserve.cli_chat import EXAMPLES
from treeserve.gateway.passwords import hash_password

MASTER = "sk-chat-master"
PRICE_IN, PRICE_OUT = 1e-6, 1e-4
WEATHER = re.compile(r"weather in ([A-Za-z ]+)", re.I)
MATHS = re.compile(r"(solve|integrate|simplify|evaluate|compute)\s+(.+?)(?:\s+for\s+([a-z]))?\s*\??$", re.I)


class Tap:
    """An ASGI wrapper that records the JSON body of every POST the wrapped app receives."""

    def __init__(self, app):
        self.app, self.bodies = app, []
        self.state = SimpleNamespace()  # not the app's: `running_server` must not shut its engine down

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        with contextlib.suppress(ValueError):
            self.bodies.append((scope["path"], json.loads(body)))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)


def _chunk(delta: dict, finish: str | None = None) -> str:
    event = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
             "model": "scripted", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(event)}\n\n"


def _choose(message: str) -> tuple[str, str]:
    """What a function-calling model would pick for these tests' messages: (tool, arguments JSON)."""
    maths, weather = MATHS.search(message), WEATHER.search(message)
    if maths:
        operation = maths.group(1).lower().replace("compute", "evaluate")
        variable = {"variable": maths.group(3)} if maths.group(3) else {}
        return "sympy", json.dumps({"operation": operation, "expression": maths.group(2), **variable})
    if weather:
        return "weather", json.dumps({"location": weather.group(1)})
    if message.lower().startswith("look up "):
        return "wikipedia", json.dumps({"query": message[8:]})
    return "answer_directly", "{}"


def scripted_app() -> FastAPI:
    app = FastAPI()
    app.state.requests, app.state.finished = [], 0
    app.state.queue_full = False  # set: every request refused as a full server's (treeserve's --max-queue 429)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        if app.state.queue_full:
            return JSONResponse({"error": {"message": "the server is busy: 8 requests are waiting (--max-queue); "
                                           "retry later", "type": "server_busy", "code": "queue_full"}},
                                status_code=429, headers={"Retry-After": "1"})
        last = body["messages"][-1]["content"]
        if body.get("tools"):
            name, arguments = _choose(last)
            pieces = [_chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                   "function": {"name": name, "arguments": ""}}]})]
            pieces += [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[i:i + 8]}}]})
                       for i in range(0, len(arguments), 8)]
            pieces.append(_chunk({}, "tool_calls"))
        else:
            pieces = [_chunk({"role": "assistant", "content": ""})]
            pieces += [_chunk({"content": last[i:i + 6]}) for i in range(0, len(last), 6)]
            pieces.append(_chunk({}, "stop"))
        usage = {"prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}
        pieces.append(f"data: {json.dumps({'id': 'chatcmpl-scripted', 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n")
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the scripted model only streams"}}, status_code=400)
        delay = 0.2 if last.startswith("slowly:") else 0.0  # slow enough for a person to press Stop

        async def stream():
            for piece in pieces + ["data: [DONE]\n\n"]:
                yield piece
                await asyncio.sleep(delay)
            app.state.finished += 1
        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def services_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []

    @app.get("/weather")
    async def weather(q: str):
        app.state.requests.append(("weather", q))
        return PlainTextResponse(f"{q}: 18 C, light rain")

    @app.get("/wiki")
    async def wiki(q: str):
        app.state.requests.append(("wikipedia", q))
        return PlainTextResponse(f"{q} is the subject of a Wikipedia article.")

    return app


def gateway_config(database: str, backend: str, scripted: str, services: str, router: str = "router") -> GatewayConfig:
    models = {"arith-gen": ModelConfig("arith-gen", [BackendConfig(backend)], PRICE_IN, PRICE_OUT),
              "arith-prm": ModelConfig("arith-prm", [BackendConfig(backend)]),
              "arith-router": ModelConfig("arith-router", [BackendConfig(backend)]),
              "router": ModelConfig("router", [BackendConfig(scripted, model="scripted")]),
              # arith-router under another name, shown the conversation (router_history: true, as for
              # any router but the bundled one), with a backend that measures it
              "fc-router": ModelConfig("fc-router", [BackendConfig(backend, model="arith-router")]),
              "echo": ModelConfig("echo", [BackendConfig(scripted, model="scripted")])}
    # (the bundled router shown the last message alone, as `treeserve chat` configures it)
    chat = ChatConfig(enabled=True, verifiers={"arith-gen": "arith-prm"}, router_model=router,
                      router_history=router != "arith-router",
                      tools={"weather": services + "/weather", "wikipedia": services + "/wiki"},
                      examples={"arith-gen": EXAMPLES})
    return GatewayConfig(models=models, master_key=MASTER, database=database, health_interval=0, chat=chat)


@contextlib.contextmanager
def arith_backend():
    """The bundled arith-gen + arith-prm + arith-router behind a real treeserve server (as `treeserve
    chat` starts it) and a Tap: (URL, tap)."""
    from treeserve.model.registry import CHAT_MODELS, CHAT_TOOL_PARSER
    from treeserve.server.launch import build_app
    from treeserve.server.tool_calls import ToolSettings

    # an explicit KV budget: the default one subtracts the whole test process's resident memory, which
    # late in the suite left nothing for three models (CI: "no memory is left for KV blocks")
    app = build_app(dict(CHAT_MODELS), dtype="float32", device="cpu", tool_settings=ToolSettings(CHAT_TOOL_PARSER),
                    kv_cache_memory_bytes=512 << 20)
    tap = Tap(app)
    try:
        with running_server(tap) as url:
            yield url, tap
    finally:
        app.state.engine.shutdown()


@contextlib.contextmanager
def chat_stack(database: str, backend_url: str, router: str = "router"):
    """The gateway with its chat in front of the backend, the scripted model and the services:
    (gateway URL, gateway app, scripted app, services app); tools mode routed by `router`."""
    scripted, services = scripted_app(), services_app()
    with running_server(scripted) as scripted_url, running_server(services) as services_url:
        gateway = build_gateway(gateway_config(database, backend_url, scripted_url, services_url, router))
        with running_server(gateway) as url:
            yield url, gateway, scripted, services


def add_user(gateway_app, user_id: str, password: str, **fields) -> None:
    gateway_app.state.store.accounts.create_user(user_id, password_hash=hash_password(password), **fields)


def stopped_answers(url: str) -> float:
    """The gateway's count of chat answers stopped (their stream cut off) so far."""
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
    line = next((m for m in metrics.splitlines()
                 if m.startswith('treeserve_gateway:chat_messages_total{mode="chat",status="stopped"}')), None)
    return float(line.split()[-1]) if line else 0.0
