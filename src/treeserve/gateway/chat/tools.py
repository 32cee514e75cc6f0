"""Tools mode's tools, as OpenAI function definitions, and running the one a router model chose.

The router sees every configured tool plus `answer_directly` (the paper's "no tool needed"
function); SymPy runs in-house (`sympy_tool`), weather and Wikipedia are HTTP services configured by
URL and asked `GET URL?q=QUERY`."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from treeserve.gateway.chat.sympy_tool import OPERATIONS, SympyWorker

ANSWER_DIRECTLY = "answer_directly"
MAX_RESULT_CHARS = 4000
ROUTER_PROMPT = ("Choose the tool that answers the user's message best. Use sympy for calculations and algebra, "
                 f"and {ANSWER_DIRECTLY} when no tool is needed.")


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


SYMPY = _function("sympy", "Exact maths with SymPy: evaluate or simplify an expression, solve an equation "
                  "(or expression = 0) for a variable, or integrate an expression.",
                  {"operation": {"type": "string", "enum": list(OPERATIONS)},
                   "expression": {"type": "string", "description": "e.g. 2**10 - 1, x**2 - 4 = 0, sin(x)*x"},
                   "variable": {"type": "string", "description": "the variable to solve or integrate for"}},
                  ["operation", "expression"])
HTTP_TOOLS = {
    "weather": _function("weather", "The current weather at a place.",
                         {"location": {"type": "string"}}, ["location"]),
    "wikipedia": _function("wikipedia", "A summary of the Wikipedia article on a subject.",
                           {"query": {"type": "string"}}, ["query"]),
}
ANSWER = _function(ANSWER_DIRECTLY, "No tool is needed: the chat model answers the message itself.", {}, [])


@dataclass
class ToolRun:
    name: str
    arguments: dict
    ok: bool
    result: str

    def as_dict(self) -> dict:
        return {"name": self.name, "input": self.arguments, "ok": self.ok, "result": self.result}


class Toolbox:
    def __init__(self, urls: dict[str, str], timeout: float):
        self.urls, self.timeout = urls, timeout
        self.client: aiohttp.ClientSession | None = None  # made on the first HTTP tool call
        self.sympy = SympyWorker(timeout)

    def definitions(self) -> list[dict]:
        return [SYMPY, *(HTTP_TOOLS[name] for name in sorted(self.urls)), ANSWER]

    async def run(self, name: str, arguments_json: str) -> ToolRun:
        try:
            arguments = json.loads(arguments_json or "{}")
        except ValueError:
            return ToolRun(name, {"raw": arguments_json}, False, "the model's arguments are not JSON")
        if not isinstance(arguments, dict):
            return ToolRun(name, {"raw": arguments}, False, "the model's arguments are not a JSON object")
        if name == "sympy":
            ok, text = await self.sympy.call(str(arguments.get("operation", "evaluate")),
                                             arguments.get("expression", ""), arguments.get("variable") or None)
            return ToolRun(name, arguments, ok, text)
        if name in self.urls:
            ok, text = await self._http(name, arguments)
            return ToolRun(name, arguments, ok, text)
        return ToolRun(name, arguments, False, f"no tool named {name!r} is configured")

    async def _http(self, name: str, arguments: dict) -> tuple[bool, str]:
        query = str(arguments.get("location") or arguments.get("query") or "")
        if not query:
            return False, f"{name}: the model gave no query"
        self.client = self.client or aiohttp.ClientSession()
        try:
            async with self.client.get(self.urls[name], params={"q": query},
                                       timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                text = (await response.content.read(MAX_RESULT_CHARS * 4)).decode("utf-8", "replace")[:MAX_RESULT_CHARS]
                if response.status != 200:
                    return False, f"{name} answered HTTP {response.status}: {text[:200]}"
                return True, text
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, f"{name} could not be reached: {type(exc).__name__} {exc}"

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        await asyncio.to_thread(self.sympy.close)  # (waits for a call in progress, off the event loop)
