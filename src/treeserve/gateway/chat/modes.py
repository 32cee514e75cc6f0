"""How a chat message is answered, as a stream of events for the page:

- chat: the conversation (system prompt, history, the new message) streamed from the chosen model,
  its oldest turns left out where they would not fit the model's context (window.py);
- search: the last question through `/v1/search` with the model's verifier: progress events, then
  the chosen answer with every candidate and its step scores;
- tools (the paper's chatbot): the conversation, windowed as in chat to the router model's context,
  goes to the router with the tools and `answer_directly` (its system prompt in place of the
  user's; a router configured `chat.router_history: false`, trained on single messages, gets the last one alone); a tool call is recognised from the router's first streamed delta, the tool runs and its
  result is the answer; otherwise the chat model answers as in chat mode.

Each mode fills an `Answer` (what is stored) while it yields events; an error raises UpstreamError."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi.responses import Response

from treeserve.gateway.chat.settings import ChatSettings
from treeserve.gateway.chat.tools import ANSWER_DIRECTLY, ROUTER_PROMPT, Toolbox
from treeserve.gateway.chat.upstream import UpstreamError, stream_events
from treeserve.gateway.chat.window import Window, fit
from treeserve.gateway.errors import GatewayError
from treeserve.gateway.http_errors import to_api_error
from treeserve.gateway.keys import KeyRecord
from treeserve.wire.errors import APIError

Dispatch = Callable[[str, dict, KeyRecord], Awaitable[Response]]


@dataclass
class Answer:
    model: str
    content: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    details: dict = field(default_factory=dict)
    streamed_usage: dict | None = None  # a stream's usage so far (with continuous_usage_stats, each chunk's is the running total)

    def add_usage(self, usage: dict | None) -> None:
        if usage:
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.completion_tokens += int(usage.get("completion_tokens") or 0)

    def see_usage(self, usage: dict | None) -> None:
        self.streamed_usage = usage or self.streamed_usage

    def settle_usage(self) -> None:
        """The stream's last running total is added (however it ended: a reply stopped or cut keeps
        the tokens it was billed for)."""
        self.add_usage(self.streamed_usage)
        self.streamed_usage = None


@dataclass
class Context:
    dispatch: Dispatch
    key: KeyRecord
    settings: ChatSettings
    history: list[dict]      # stored messages before the new one (public_message dicts)
    question: str
    verifier: str | None = None
    router_model: str | None = None
    router_history: bool = True  # the router shown the conversation (false: the last message alone)
    toolbox: Toolbox | None = None
    count_tokens: Dispatch | None = None  # a chat's prompt measured by its backend: (body, key) -> /tokenize's reply


def model_messages(context: Context) -> list[dict]:
    """What the answering model sees: the system prompt, the history without tool acknowledgements
    (tools mode's answers), empty stopped answers or failed ones with their question (a message the
    model refused must not be sent again with every later one), and the new message."""
    messages = [{"role": "system", "content": context.settings.system_prompt}] if context.settings.system_prompt else []
    history = context.history
    for position, message in enumerate(history):
        answer = history[position + 1] if message["role"] == "user" and position + 1 < len(history) else None
        if _unsent(message) or (answer is not None and _failed(answer)):
            continue
        messages.append({"role": message["role"], "content": message["content"]})
    messages.append({"role": "user", "content": context.question})
    return messages


def _unsent(message: dict) -> bool:
    return message["role"] == "assistant" and ("tool" in message["details"] or not message["content"])


def _failed(answer: dict) -> bool:
    return answer["role"] == "assistant" and "error" in answer["details"] and not answer["content"]


async def fitted_messages(context: Context, answer: Answer) -> list[dict]:
    """`model_messages` less the oldest turns that would not fit the model's context with max_tokens
    (how many were left out goes in the answer's details)."""
    window = await _window(context, model_messages(context), answer.model, context.settings.max_tokens)
    if window.left_out:
        answer.details = {**answer.details, "left_out": window.left_out}
    return window.messages


async def _window(context: Context, messages: list[dict], model: str, max_tokens: int, extra: dict | None = None) -> Window:
    """`messages` less the oldest turns that would not fit `model`'s context with `max_tokens`, measured
    by its backend with `extra` (a request's tools) as the request will carry them."""
    if context.count_tokens is None:
        return Window(messages)

    async def measure(kept: list[dict]) -> Response:
        return await _send(context, "/tokenize", {"model": model, "messages": kept, **(extra or {})},
                           context.count_tokens)
    return await fit(messages, max_tokens, model, measure)


async def _send(context: Context, path: str, body: dict, dispatch: Dispatch | None = None) -> Response:
    try:
        return await (dispatch or context.dispatch)(path, body, context.key)
    except (APIError, GatewayError) as exc:  # refused by the gateway itself: a model not allowed, a budget, a limit
        refusal = exc if isinstance(exc, APIError) else to_api_error(exc)
        # (a model the chat key may not use is the API's 401, LiteLLM's; the page reads a 401 as its session
        # ended: the chat's own answer for it is a 403, as chat/routes.py's)
        status = 403 if refusal.code == "model_not_allowed" else refusal.status
        raise UpstreamError(refusal.message, refusal.code, status) from None
    except ValueError as exc:  # a parameter the gateway refused (ParamError names it)
        raise UpstreamError(str(exc), status=400) from None


async def chat(context: Context, answer: Answer) -> AsyncIterator[dict]:
    # usage in every chunk (settle_usage)
    body = {"model": answer.model, "messages": await fitted_messages(context, answer), "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **context.settings.sampling()}
    try:
        async with aclosing(stream_events(await _send(context, "/v1/chat/completions", body))) as events:
            async for event in events:
                answer.see_usage(event.get("usage"))
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        answer.content += text
                        yield {"type": "delta", "text": text}
    finally:
        answer.settle_usage()


async def search(context: Context, answer: Answer) -> AsyncIterator[dict]:
    if context.verifier is None:
        raise UpstreamError(f"search mode needs a verifier for {answer.model!r}; this gateway has none configured")
    settings = context.settings
    messages = ([{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []) + \
        [{"role": "user", "content": context.question}]
    body = {"model": answer.model, "verifier": context.verifier, "messages": messages, "stream": True,
            "n": settings.search_n, "strategy": settings.search_strategy, "temperature": settings.temperature, "top_p": settings.top_p,
            "max_tokens": settings.max_tokens}
    async with aclosing(stream_events(await _send(context, "/v1/search", body))) as events:
        async for event in events:
            if event.get("object") == "search.progress":
                yield {"type": "progress", **{k: v for k, v in event.items() if k != "object"}}
            elif event.get("object") == "search.result":
                answer.content = event.get("completion") or ""
                answer.add_usage(event.get("usage"))
                answer.details = {"search": {k: event.get(k) for k in (
                    "verifier", "strategy", "n", "answer", "score", "verifier_rejected_all", "chosen", "candidates",
                    "tree_size", "seconds")}}
                yield {"type": "result", "content": answer.content, "details": answer.details}


async def tools(context: Context, answer: Answer) -> AsyncIterator[dict]:
    router = context.router_model or answer.model
    yield {"type": "routing", "router": router}
    tools = {"tools": context.toolbox.definitions(), "tool_choice": "required"}
    window = await _window(context, router_messages(context, router, context.router_history), router, ROUTER_MAX_TOKENS, tools)
    # usage in every chunk: the router's stream is dropped before its last chunk, which alone would carry it
    body = {"model": router, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": window.messages, **tools, "temperature": 0.0, "max_tokens": ROUTER_MAX_TOKENS}
    name, arguments = await _route(context, body, answer)
    routed = {"router": router, **({"router_left_out": window.left_out} if window.left_out else {})}
    if name is None or name == ANSWER_DIRECTLY:
        answer.details = {**routed, "routed_to": ANSWER_DIRECTLY}
        yield {"type": "routed", "tool": ANSWER_DIRECTLY}
        async with aclosing(chat(context, answer)) as events:
            async for event in events:
                yield event
        return
    run = await context.toolbox.run(name, arguments)
    answer.content = run.result if run.ok else f"The {run.name} tool failed: {run.result}"
    answer.details = {**routed, "tool": run.as_dict()}
    yield {"type": "tool", **run.as_dict()}
    yield {"type": "delta", "text": answer.content}


# The bundled tool router's served name: it saw powers only as `**` in training (tasks/router.py)
BUNDLED_ROUTER = "arith-router"
ROUTER_MAX_TOKENS = 256  # a call's arguments: the router writes no more


def router_messages(context: Context, router: str, history: bool = True) -> list[dict]:
    """What the router sees: its own system prompt, then the conversation as the chat model would see
    it (tool answers left out), each of the user's messages as `router_text` writes it. Without
    `history` (`chat.router_history: false`, for a router trained on one message per prompt: shown
    earlier messages, the bundled one copied its arguments from them, 19 of tests/test_chat_router.py's
    20 questions wrong), the last message alone: a property of the model, not of the name it is served
    under, so the gateway's configuration says it."""
    messages = [m for m in model_messages(context) if m["role"] != "system"]
    if not history:
        messages = messages[-1:]
    return [{"role": "system", "content": ROUTER_PROMPT}] + [
        {**m, "content": router_text(m["content"], router)} if m["role"] == "user" else m for m in messages]


def router_text(question: str, router: str) -> str:
    """The message as the router is shown it: for the bundled arith-router, powers written `**` (it
    read `x^2` as `x`; SymPy reads both); another router gets the user's text as it is."""
    return question.replace("^", "**") if router == BUNDLED_ROUTER else question


async def _route(context: Context, body: dict, answer: Answer) -> tuple[str | None, str]:
    """The router's first tool call (name, arguments JSON), or (None, '') when its first delta is
    text: then it chose to answer itself. The stream is dropped as soon as the choice is known (text,
    `answer_directly`, or a call whose arguments are whole), so the router writes no more than that."""
    try:
        return await _first_call(context, body, answer)
    finally:
        answer.settle_usage()


async def _first_call(context: Context, body: dict, answer: Answer) -> tuple[str | None, str]:
    name, arguments = None, ""
    async with aclosing(stream_events(await _send(context, "/v1/chat/completions", body))) as events:
        async for event in events:
            answer.see_usage(event.get("usage"))
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if name is None and (delta.get("content") or "").strip():
                    return None, ""
                for call in delta.get("tool_calls") or ():
                    if call.get("index", 0) != 0:
                        continue  # the first call is the choice
                    function = call.get("function") or {}
                    name = name or function.get("name")
                    arguments += function.get("arguments") or ""
            if name == ANSWER_DIRECTLY or (name and _whole(arguments)):
                return name, arguments
    return name, arguments


def _whole(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


MODES = {"chat": chat, "search": search, "tools": tools}
