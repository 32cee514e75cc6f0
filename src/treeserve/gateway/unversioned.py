"""LiteLLM's OpenAI routes without their `/v1`: LiteLLM's proxy answers `/chat/completions`,
`/completions`, `/models`, `/responses`, `/files` and `/batches` as it answers them under `/v1` (its
quick start points the OpenAI client at `http://0.0.0.0:4000`, which then calls `/chat/completions`),
so a client moved from it sends these; `/conversations` goes with `/responses` (a client whose base
URL has no `/v1` calls both there). A plain ASGI middleware, installed outermost: the path is
rewritten before anything reads it (the body limit, the routes, the logs), so such a request is the
`/v1` route's own, with its key check, limits and billing."""
from __future__ import annotations

UNVERSIONED = ("/chat/completions", "/completions", "/models", "/responses", "/conversations", "/files", "/batches")


def versioned_path(path: str) -> str:
    """`/v1` + `path` for one of LiteLLM's unversioned OpenAI paths; any other path as it is (the web
    chat's `/chat/...` among them)."""
    if any(path == prefix or path.startswith(prefix + "/") for prefix in UNVERSIONED):
        return "/v1" + path
    return path


class UnversionedPathMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = versioned_path(scope["path"])
            if path != scope["path"]:
                scope = dict(scope, path=path)
                if scope.get("raw_path") is not None:
                    scope["raw_path"] = b"/v1" + scope["raw_path"]
        await self.app(scope, receive, send)
