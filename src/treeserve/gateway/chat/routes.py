"""The web chat's routes: the page (`/chat`, `/chat/c/ID`), its assets, and its JSON API under
`/chat/api` (sign-in, conversations, messages streamed as server-sent events over POST, a message
edited (PUT) or its answer regenerated, exports).

A signed-in browser holds a random session cookie (HttpOnly, SameSite=Strict, stored hashed);
every request that changes something must also carry the session's CSRF token in `X-CSRF-Token`
(the page reads it from `/chat/api/me`). A conversation is reachable only by its owner: any other
id answers 404. The chat's model requests go through the gateway's own `GatewayService.dispatch`, so
they are admitted, routed, billed and limited like any key's (each user has one chat key)."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from treeserve import jsonl
from treeserve.gateway.chat import export
from treeserve.gateway.chat.modes import MODES, Answer, Context
from treeserve.gateway.chat.restart import first_output
from treeserve.gateway.chat.settings import ChatSettings, ConversationIn, LoginIn, MessageIn, RegenerateIn
from treeserve.gateway.chat.store import ChatStore
from treeserve.gateway.chat.throttle import LoginThrottle
from treeserve.gateway.chat.tools import Toolbox
from treeserve.gateway.chat.upstream import UpstreamError
from treeserve.gateway.config import GatewayConfig
from treeserve.gateway.errors import ConversationNotFound, QuestionReplaced
from treeserve.gateway.keys import same_secret
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.proxy import RelayResponse
from treeserve.gateway.service import GatewayService
from treeserve.wire.errors import APIError

log = logging.getLogger("treeserve.gateway.chat")
COOKIE = "treeserve_chat"
STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css"}
# what the page loads (its scripts and style sheet, named in index.html), nothing else of the folder
ASSETS = {name: MEDIA_TYPES[Path(name).suffix]
          for name in re.findall(r'"/chat/static/([\w.-]+)"', (STATIC / "index.html").read_text(encoding="utf-8"))}
# The page runs only its own script and style: an answer that smuggled markup in could run nothing.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
                "frame-ancestors 'none'; form-action 'self'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin", "Cache-Control": "no-store"}
PASSWORD_CHECKS = 2  # Argon2 checks at once


async def signed_in(request: Request) -> Signed:
    """The signed-in user (401 without a live session; 403 for a change without the CSRF token)."""
    chats: ChatStore = request.app.state.chat.chats
    token = request.cookies.get(COOKIE)
    found = await run_in_threadpool(chats.session_user, token) if token else None
    if found is None:
        raise APIError(401, "not signed in (or the session ended): sign in at /chat", code="not_signed_in")
    user_id, csrf = found
    if request.method not in ("GET", "HEAD") and not same_secret(request.headers.get("x-csrf-token", ""), csrf):
        raise APIError(403, "the X-CSRF-Token header is missing or wrong", code="csrf_failed")
    return Signed(user_id, csrf, token)


@dataclass
class Signed:
    user_id: str
    csrf_token: str
    token: str


class ChatApp:
    def __init__(self, config: GatewayConfig, service: GatewayService, chats: ChatStore, metrics: GatewayMetrics):
        """`service`: the gateway's request path, which the chat's model requests go through."""
        self.config, self.service, self.chats, self.metrics = config, service, chats, metrics
        self.toolbox = Toolbox(config.chat.tools, config.chat.tool_timeout)
        self.throttle = LoginThrottle()
        self.password_checks = anyio.CapacityLimiter(PASSWORD_CHECKS)
        verifiers = set(config.chat.verifiers.values())
        self.chat_models = [m for m in config.models if m not in verifiers] or list(config.models)
        self.router = self._routes()

    async def close(self) -> None:
        await self.toolbox.close()

    # ---- who is asking -------------------------------------------------------------------------
    def settings_for(self, settings: ChatSettings | dict | None) -> ChatSettings:
        """Settings with the model filled in and checked against what this gateway serves."""
        settings = settings if isinstance(settings, ChatSettings) else ChatSettings(**(settings or {}))
        if settings.model is None:
            settings = settings.model_copy(update={"model": self.chat_models[0]})
        if settings.model not in self.config.models:
            raise APIError(400, f"settings.model: {settings.model!r} is not served by this gateway",
                           param="settings.model", code="model_not_found")
        if settings.mode == "search" and settings.model not in self.config.chat.verifiers:
            raise APIError(400, f"settings.mode: search needs a verifier for {settings.model!r}; this gateway "
                           f"has one for {sorted(self.config.chat.verifiers) or 'no model'}", param="settings.mode")
        return settings

    # ---- routes ----------------------------------------------------------------------------------
    def _routes(self) -> APIRouter:
        router = APIRouter(tags=["chat"])
        router.add_api_route("/chat", self.page, methods=["GET"], include_in_schema=False)
        router.add_api_route("/chat/c/{conversation_id}", self.page, methods=["GET"], include_in_schema=False)
        router.add_api_route("/chat/static/{name}", self.asset, methods=["GET"], include_in_schema=False)
        router.add_api_route("/chat/api/login", self.login, methods=["POST"])
        router.add_api_route("/chat/api/logout", self.logout, methods=["POST"])
        router.add_api_route("/chat/api/me", self.me, methods=["GET"])
        router.add_api_route("/chat/api/conversations", self.list_conversations, methods=["GET"])
        router.add_api_route("/chat/api/conversations", self.new_conversation, methods=["POST"])
        router.add_api_route("/chat/api/conversations/{conversation_id}", self.get_conversation, methods=["GET"])
        router.add_api_route("/chat/api/conversations/{conversation_id}", self.update_conversation,
                             methods=["PATCH"])
        router.add_api_route("/chat/api/conversations/{conversation_id}", self.delete_conversation,
                             methods=["DELETE"])
        router.add_api_route("/chat/api/conversations/{conversation_id}/messages", self.send, methods=["POST"])
        router.add_api_route("/chat/api/conversations/{conversation_id}/messages/{message_id}", self.edit,
                             methods=["PUT"])
        router.add_api_route("/chat/api/conversations/{conversation_id}/regenerate", self.regenerate,
                             methods=["POST"])
        router.add_api_route("/chat/api/conversations/{conversation_id}/export", self.export_one, methods=["GET"])
        router.add_api_route("/chat/api/export", self.export_all, methods=["GET"])
        return router

    async def page(self, conversation_id: str | None = None) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    async def asset(self, name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no asset {name!r}", code="not_found")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"X-Content-Type-Options": "nosniff"})

    async def login(self, body: LoginIn, request: Request) -> Response:
        wait = self.throttle.attempt(body.user_id)
        if wait:
            self.metrics.chat_sign_ins.labels("throttled").inc()
            raise APIError(429, f"too many sign-in attempts for {body.user_id!r}; try again in {wait} s",
                           code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        # Argon2 takes ~50 ms and 64 MiB a check: a few at a time, whatever the number of clients
        checked = await anyio.to_thread.run_sync(self.chats.check_password, body.user_id, body.password,
                                                 limiter=self.password_checks)
        self.metrics.chat_sign_ins.labels("ok" if checked else "refused").inc()
        if not checked:
            log.warning("failed chat sign-in for %r", body.user_id)
            raise APIError(401, "wrong user name or password", code="invalid_credentials")
        self.throttle.succeeded(body.user_id)
        token, csrf = await run_in_threadpool(self.chats.start_session, body.user_id)
        response = JSONResponse({"user_id": body.user_id, "csrf_token": csrf})
        response.set_cookie(COOKIE, token, max_age=7 * 86400, path="/chat", httponly=True, samesite="strict",
                            secure=self.config.chat.cookie_secure or request.url.scheme == "https")
        return response

    async def logout(self, signed: Signed = Depends(signed_in)) -> Response:
        await run_in_threadpool(self.chats.end_session, signed.token)
        response = JSONResponse({"signed_out": True})
        response.delete_cookie(COOKIE, path="/chat")
        return response

    async def me(self, signed: Signed = Depends(signed_in)) -> dict:
        key = await run_in_threadpool(self.chats.chat_key, signed.user_id)
        usage = await run_in_threadpool(self.chats.usage, signed.user_id)
        return {"user_id": signed.user_id, "csrf_token": signed.csrf_token,
                "models": [m for m in self.chat_models if key.allows(m)],
                "search_models": sorted(m for m, v in self.config.chat.verifiers.items() if key.allows(m)
                                        and key.allows(v)),  # (a search needs its verifier too)
                "tools": [d["function"]["name"] for d in self.toolbox.definitions()],
                "examples": {m: e for m, e in self.config.chat.examples.items() if key.allows(m)},
                "defaults": self.settings_for(None).model_dump(), "usage": usage}

    async def list_conversations(self, signed: Signed = Depends(signed_in)) -> dict:
        return {"conversations": await run_in_threadpool(self.chats.conversations, signed.user_id)}

    async def new_conversation(self, body: ConversationIn, signed: Signed = Depends(signed_in)) -> dict:
        settings = self.settings_for(body.settings).model_dump()
        return await run_in_threadpool(self.chats.create, signed.user_id, body.title or "", settings)

    async def get_conversation(self, conversation_id: str, signed: Signed = Depends(signed_in)) -> dict:
        return await run_in_threadpool(self.chats.get, signed.user_id, conversation_id)

    async def update_conversation(self, conversation_id: str, body: ConversationIn,
                                  signed: Signed = Depends(signed_in)) -> dict:
        settings = self.settings_for(body.settings).model_dump() if body.settings is not None else None
        return await run_in_threadpool(self.chats.update, signed.user_id, conversation_id, body.title, settings)

    async def delete_conversation(self, conversation_id: str, signed: Signed = Depends(signed_in)) -> dict:
        await run_in_threadpool(self.chats.delete, signed.user_id, conversation_id)
        return {"deleted": conversation_id}

    async def export_one(self, conversation_id: str, format: Literal["xlsx", "json"] = "xlsx",
                         signed: Signed = Depends(signed_in)) -> Response:
        rows = await run_in_threadpool(self.chats.export_rows, signed.user_id, conversation_id)
        return await _export(signed.user_id, rows, format, f"conversation-{conversation_id}")

    async def export_all(self, format: Literal["xlsx", "json"] = "xlsx", signed: Signed = Depends(signed_in)):
        rows = await run_in_threadpool(self.chats.export_rows, signed.user_id)
        return await _export(signed.user_id, rows, format, "conversations")

    async def send(self, conversation_id: str, body: MessageIn, signed: Signed = Depends(signed_in)) -> Response:
        return await self._reply(signed.user_id, conversation_id, body.settings, body.content)

    async def edit(self, conversation_id: str, message_id: int, body: MessageIn, request: Request,
                   signed: Signed = Depends(signed_in)) -> Response:
        """The user's message `message_id` sent again as `content`; what followed it is replaced."""
        return await self._reply(signed.user_id, conversation_id, body.settings, body.content, restart="edit",
                                 message_id=message_id, request=request)

    async def regenerate(self, conversation_id: str, request: Request, body: RegenerateIn | None = None,
                         signed: Signed = Depends(signed_in)) -> Response:
        """The user's last message answered again; its answer is replaced."""
        return await self._reply(signed.user_id, conversation_id, body.settings if body else None, None,
                                 restart="regenerate", request=request)

    async def _reply(self, user_id: str, conversation_id: str, settings: ChatSettings | None, content: str | None,
                     restart: str | None = None, message_id: int | None = None,
                     request: Request | None = None) -> Response:
        """A message stored (a new one, or where `restart`, the user's message `message_id` (their last
        when None) stored again, `content` replacing its text, with what followed it deleted) and its
        answer streamed as the page's events. A restart changes nothing until its answer has begun
        (chat/restart.py): refused before that, it is an HTTP error and the old answer stays; the page gone
        by then (Stop, a closed tab), nothing is changed either."""
        conversation = await run_in_threadpool(self.chats.get, user_id, conversation_id)
        settings = self.settings_for(settings or conversation["settings"])
        key = await run_in_threadpool(self.chats.chat_key, user_id)
        if not key.allows(settings.model):
            raise APIError(403, f"settings.model: you may not use {settings.model!r}", param="settings.model",
                           code="model_not_allowed")
        verifier = self.config.chat.verifiers.get(settings.model) if settings.mode == "search" else None
        if verifier is not None and not key.allows(verifier):
            raise APIError(403, f"settings.mode: search with {settings.model!r} needs its verifier {verifier!r}, "
                           "which you may not use", param="settings.mode", code="model_not_allowed")
        fields = {"model": settings.model, "mode": settings.mode, "settings": settings.model_dump()}
        if restart:
            question, history = await run_in_threadpool(self.chats.restart_plan, user_id, conversation_id, message_id)
            content = question["content"] if content is None else content
        else:
            title = conversation["title"] if conversation["messages"] or conversation["title"] != "New chat" \
                else content[:60]
            await run_in_threadpool(self.chats.update, user_id, conversation_id, title, fields["settings"])
            stored = await run_in_threadpool(lambda: self.chats.add_message(
                user_id, conversation_id, "user", content, **fields))
            history = conversation["messages"]
        context = Context(self.service.dispatch, key, settings, history, content,
                          self.config.chat.verifiers.get(settings.model), self.config.chat.router_model,
                          self.config.chat.router_history, self.toolbox, self._count_tokens)
        answer = Answer(settings.model)
        mode = MODES[settings.mode](context, answer)
        begun: list[dict] = []
        if restart:
            begun = await first_output(mode)
            if request is not None and await request.is_disconnected():  # (no response would save its answer)
                with anyio.CancelScope(shield=True):
                    await mode.aclose()
                return Response(status_code=499)  # (nginx's "client closed request": no one reads it)
            stored = await self._restart(user_id, conversation_id, question["id"], content, fields, restart, mode)
        events = self._answer(user_id, conversation_id, stored, context, mode, answer, begun)
        # started here, inside its try: gone from now on, the response that never began still saves the answer
        first = await events.__anext__()
        return RelayResponse(_after(first, events), media_type="text/event-stream", also_close=events,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _restart(self, user_id: str, conversation_id: str, message_id: int, content: str, fields: dict,
                       restart: str, mode) -> dict:
        """The restart stored, its answer having begun: the message stored anew, what followed it deleted."""
        try:
            stored, _ = await run_in_threadpool(lambda: self.chats.restart_at(
                user_id, conversation_id, message_id, content, **fields))
            await run_in_threadpool(self.chats.update, user_id, conversation_id, None, fields["settings"])
        except BaseException:  # (deleted or replaced meanwhile: its answer's request is closed)
            with anyio.CancelScope(shield=True):
                await mode.aclose()
            raise
        self.metrics.chat_restarts.labels(restart).inc()
        return stored

    async def _count_tokens(self, path: str, body: dict, key) -> Response:
        return await self.service.count_tokens(body, key)  # (`path` is /tokenize: not dispatched, unbilled)

    async def _answer(self, user_id: str, conversation_id: str, stored: dict, context: Context, mode, answer: Answer,
                      begun: list[dict]):
        """The page's events: the stored user message, the mode's events (`begun`: those it gave before the
        message was stored), the stored answer. However the stream ends (done, an error, the Stop
        button), the answer so far is kept."""
        settings = context.settings
        status, saving = "stopped", False

        async def save() -> dict | None:
            nonlocal saving
            saving = True
            details = answer.details if status == "done" else {**answer.details, "status": status}
            self.metrics.chat_messages.labels(settings.mode, status).inc()
            if "tool" in answer.details:
                self.metrics.chat_tool_calls.labels(answer.details["tool"]["name"],
                                                    "ok" if answer.details["tool"]["ok"] else "failed").inc()
            log.info("chat %s user=%s conversation=%s mode=%s model=%s tokens=%d+%d", status, user_id,
                     conversation_id, settings.mode, settings.model, answer.prompt_tokens, answer.completion_tokens)
            try:
                return await run_in_threadpool(lambda: self.chats.add_message(
                    user_id, conversation_id, "assistant", answer.content, answers=stored["id"],
                    model=settings.model, mode=settings.mode,
                    settings=settings.model_dump(), prompt_tokens=answer.prompt_tokens,
                    completion_tokens=answer.completion_tokens, details=details))
            except (ConversationNotFound, QuestionReplaced):  # deleted, or edited or regenerated, meanwhile
                return None

        try:
            yield _sse({"type": "user", "message": stored})
            try:
                for event in begun:
                    yield _sse(event)
                async for event in mode:
                    yield _sse(event)
                status = "done"
            except UpstreamError as exc:
                status = "error"
                answer.details = {**answer.details, "error": str(exc)}
                yield _sse({"type": "error", "message": str(exc), **({"code": exc.code} if exc.code else {})})
            except Exception as exc:
                log.exception("answering in %s mode failed", settings.mode)
                status = "error"
                answer.details = {**answer.details, "error": f"internal error ({type(exc).__name__}); see the "
                                  "gateway's log"}
                yield _sse({"type": "error", "message": answer.details["error"]})
            yield _sse({"type": "done", "message": await save()})
        finally:
            with anyio.CancelScope(shield=True):
                await mode.aclose()  # a stopped answer's upstream request is closed (and settled) now
                if not saving:
                    await save()


async def _export(user_id: str, conversations: list[dict], format: str, name: str) -> Response:
    if format == "json":
        content, media = await run_in_threadpool(export.to_json, user_id, conversations), "application/json"
    else:
        content = await run_in_threadpool(export.to_xlsx, conversations)
        media = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
    return Response(content, media_type=media,
                    headers={"Content-Disposition": f'attachment; filename="{name}.{format}"'})


async def _after(first: bytes, rest):
    """`first`, then what `rest` yields (an answer's events, started already)."""
    yield first
    async for event in rest:
        yield event


def _sse(event: dict) -> bytes:
    return b"data: " + jsonl.line(event).encode() + b"\n\n"
