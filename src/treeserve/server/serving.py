"""/v1/completions and /v1/chat/completions: prompts to engine requests, outputs to OpenAI JSON/SSE."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from treeserve import jsonl
from treeserve.engine.async_engine import AsyncLLMEngine, QueueFullError
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.token_bytes import TokenBytes
from treeserve.errors import ParamError, check_context_length
from treeserve.model.registry import BUILTIN_PREFIX
from treeserve.outputs import RequestOutput
from treeserve.sampling_params import RequestOutputKind, SamplingParams
from treeserve.wire.errors import APIError, failure_body, from_validation_error, from_value_error
from treeserve.entrypoints.chat_utils import render_chat
from treeserve.wire.chat_completions import ChatCompletionRequest
from treeserve.wire.chat_messages import ChatMessage, template_messages
from treeserve.wire.completions import CompletionRequest
from treeserve.wire.tools import Tool
from treeserve.wire.translated_errors import renamed
from treeserve.server import request_log
from treeserve.server.completion_reply import (CompletionReply, DeltaTracker, chat_logprobs, prompt_logprobs_json,
                                               token_pairs)
from treeserve.server.tool_calls import ToolCallStream, ToolCalling, ToolSettings, special_tokens

def unknown_model(model: str | None, served: list[str]) -> APIError:
    """The 404 for a model this server does not serve; a name that differs from a served one only by
    `builtin:` (a bundled model is served as NAME, `builtin:NAME` being how it is loaded) gets a hint."""
    bare = model.removeprefix(BUILTIN_PREFIX) if model else model
    like = [name for name in served if name.removeprefix(BUILTIN_PREFIX) == bare]
    hint = f"; did you mean '{like[0]}'?" if like else ""
    return APIError(404, f"model: '{model}' does not exist{hint} (served: {', '.join(served)})", param="model",
                    code="model_not_found")


class OpenAIServing:
    """The OpenAI routes for one served model (an engine driven by the shared engine loop)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, llm: LLMEngine | None = None,
                 chat_template: str | None = None, tool_settings: ToolSettings | None = None,
                 trust_request_chat_template: bool = False):
        self.engine = engine
        self.llm = llm or engine.engine
        self.model_name = model_name
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = self.llm.max_model_len
        self.chat_template = chat_template  # --chat-template: replaces the tokenizer's
        self.trust_request_chat_template = trust_request_chat_template  # a request's own `chat_template` taken
        self.tool_settings = tool_settings or ToolSettings()
        self.special_tokens = special_tokens(self.tokenizer)
        self.token_bytes = TokenBytes(self.tokenizer)  # (chat logprobs' `bytes`)

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None,
               ending: tuple[bool, bool] = (True, False), template_kwargs: dict | None = None,
               add_special_tokens: bool = False, request_template: str | None = None) -> list[int]:
        """A conversation's prompt tokens, the tools rendered by the chat template, ended as `ending`
        says ((add_generation_prompt, continue_final_message)), `template_kwargs` its variables
        (vLLM's chat_template_kwargs), the tokenizer's special tokens added on top of the template's
        only when asked (/tokenize's add_special_tokens), `request_template` the request's own
        `chat_template` (a 400 naming it unless the server trusts such templates); 400 naming the problem."""
        template = self._template(request_template)
        try:
            text = render_chat(self.tokenizer, template_messages(messages),
                               [t.model_dump(exclude_none=True) for t in tools or ()], ending[0],
                               template, continue_final_message=ending[1], template_kwargs=template_kwargs)
        except ParamError as exc:
            if request_template is not None and exc.param == "messages":  # (the request's template failed)
                exc = ParamError("chat_template", exc.detail)
            raise from_value_error(exc) from exc
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _template(self, request_template: str | None) -> str | None:
        """The template to render with: the request's where it gives one the server trusts (vLLM's
        --trust-request-chat-template: a template is code the server runs, sandboxed), else --chat-template's
        or the tokenizer's."""
        if request_template is None:
            return self.chat_template
        if not self.trust_request_chat_template:
            raise APIError(400, "chat_template: a request's own chat template is refused: this server was not "
                           "started with --trust-request-chat-template (vLLM's rule); leave it out to use the "
                           "model's, or start the server with the flag", param="chat_template")
        if not request_template.strip():  # (rendered, no prompt at all: a 400 naming `prompt` instead)
            raise APIError(400, "chat_template: an empty template renders no prompt; leave chat_template out to "
                           "use the model's", param="chat_template")
        return request_template

    @staticmethod
    def _rendered_tools(request: ChatCompletionRequest) -> list:
        """The tools the prompt lists: those the model may call (an allowed_tools choice's only: a
        model is not shown a tool it may not call)."""
        try:
            return [tool for _, tool in request.usable_tools()]
        except ValueError as exc:
            raise from_value_error(exc) from exc

    @staticmethod
    def _ending(request: ChatCompletionRequest) -> tuple[bool, bool]:
        try:
            return request.template_ending()
        except ValueError as exc:
            raise from_value_error(exc) from exc

    # ---- shared -----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name != self.model_name:
            raise unknown_model(name, [self.model_name])

    def check_capacity(self, count: int) -> None:
        if self.engine.errored is not None:
            raise APIError(503, f"the engine has failed ({self.engine.errored}); restart the server",
                           code="engine_dead")
        limit = self.engine.max_queue
        if limit is not None and self.engine.num_waiting() + count > limit:
            raise APIError(429, f"the waiting queue is full ({limit} requests); retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    def _model_max_tokens(self, requested: int | None, left_out: bool) -> int | None:
        """A request that leaves max_tokens out is held to the model's generation_config
        `max_new_tokens` where it has one (as vLLM: the smaller of it and the API's own default; never
        checked against the context, the engine cuts it to the room the prompt leaves)."""
        model = self.llm.generation_defaults.sampling.get("max_tokens")
        if not left_out or model is None:
            return requested
        return model if requested is None else min(requested, model)

    def _params(self, request, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None,
                prompt_field: str, prompt_logprobs: int | None = None,
                left_out: bool = False) -> tuple[SamplingParams, list[list[int]]]:
        """The request's SamplingParams, and its prompts as they will run (cut to the last
        `truncate_prompt_tokens` tokens, as vLLM's), checked against the model."""
        try:
            params = request.sampling_params(self.llm.generation_defaults.sampling,
                                             self._model_max_tokens(max_tokens, left_out), logprobs, prompt_logprobs)
            self.llm.check_token_ids(params)  # (before a stream starts: a 400, not an error event)
            prompts = [self.llm.truncated_prompt(ids, params) for ids in prompts]
            for ids in prompts:
                check_context_length(self.max_model_len, len(ids), max_tokens, prompt_field)
                try:
                    self.llm.validate_prompt(ids)
                except ValueError as exc:  # the engine names it `prompt`; the request calls it prompt_field
                    detail = exc.detail if isinstance(exc, ParamError) else str(exc)[len("prompt: "):]
                    raise ParamError(prompt_field, detail) from exc
        except ValueError as exc:
            # (a chat that sent max_completion_tokens is told of that field, not of max_tokens)
            named = getattr(request, "max_completion_tokens", None) is not None
            raise renamed(from_value_error(exc), [(r"^max_tokens\b", "max_completion_tokens")] if named else []) \
                from exc
        # streamed: each output holds only what is new (the engine holds back a stop string's start);
        # otherwise one output, at the end (no hand-off to this event loop per request per step)
        params.output_kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        return params, prompts

    async def compile_grammar(self, request, params: SamplingParams, tools: ToolCalling | None = None) -> None:
        """Compiles the request's grammar (cached) off the event loop, before anything is queued: a
        grammar the engine rejects is a 400 naming the request's field (for forced tool calls, the
        function whose parameters it rejects)."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.llm.compile_grammar, params.structured_outputs)
        except ParamError as exc:
            if tools is not None and tools.forced:
                located = await asyncio.to_thread(tools.locate_schema_error, self.llm.compile_grammar)
                raise from_value_error(located or ParamError("tools", exc.detail)) from exc
            name = exc.param if request.structured_param == "structured_outputs" else "response_format"
            raise from_value_error(ParamError(name, exc.detail)) from exc

    async def _merged(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                      texts: list[str | None], priority: int = 0,
                      logged: list[str | None] | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs every prompt as its own engine request and yields (prompt index, output) as they come;
        `logged` is the prompt text `--enable-log-requests` shows, where it is not `texts` (a chat's)."""
        logged = texts if logged is None else logged
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, ids: list[int]) -> None:
            request_id, finished = self.engine.new_request_id(prefix), False
            try:
                request_log.received(request_id, logged[index], params, ids)
                async for output in self.engine.generate(ids, params, request_id, prompt=texts[index], engine=self.llm,
                                                         priority=priority):
                    finished = output.finished
                    await queue.put((index, output))
            except Exception as exc:
                await queue.put((index, exc))
            finally:
                request_log.ended(request_id, finished)
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, QueueFullError):
                    raise APIError(429, str(item), code="queue_full", headers={"Retry-After": "1"})
                elif isinstance(item, ValueError):
                    raise from_value_error(item)
                elif isinstance(item, Exception):
                    raise item
                else:
                    _raise_a_failed_grammar(item)
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    @staticmethod
    def _usage(finals: dict[int, RequestOutput], completion: int | None = None) -> dict:
        """`completion`: the tokens generated, where the outputs are deltas (default: counted in them)."""
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        if completion is None:
            completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals.values())
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        drafted = sum(o.num_draft_tokens for o in finals.values())
        if drafted:  # speculative decoding, in OpenAI's fields for predicted tokens kept and rejected
            accepted = sum(o.num_accepted_tokens for o in finals.values())
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": drafted - accepted}
        return usage

    # ---- chat -------------------------------------------------------------------------------
    async def chat(self, request: ChatCompletionRequest):
        result = await self.chat_result(request)
        return JSONResponse(result) if isinstance(result, dict) else _sse(result)

    async def chat_body(self, body: dict) -> dict | AsyncIterator[dict]:
        """`chat_result` for a body another API translated (wire/responses.py, wire/messages.py)."""
        return await self.chat_result(_chat_request(body))

    def render_body(self, body: dict) -> list[int]:
        """The prompt tokens of a translated chat body (its messages and tools)."""
        request = _chat_request(body)
        return self.render(request.messages, self._rendered_tools(request), self._ending(request),
                           request.template_kwargs(), request_template=request.chat_template)

    async def chat_result(self, request: ChatCompletionRequest) -> dict | AsyncIterator[dict]:
        """The reply's body, or (streamed) its chunks: what /v1/chat/completions sends, and what the
        Responses and Messages APIs translate (wire/responses.py, wire/messages.py)."""
        self.check_model(request.model)
        try:
            tools = ToolCalling.from_request(request, self.tool_settings, self.special_tokens)
            logprobs = request.requested_logprobs()
            prompt_logprobs = request.requested_prompt_logprobs()
        except ValueError as exc:
            raise from_value_error(exc) from exc
        ids = self.render(request.messages, self._rendered_tools(request), self._ending(request),
                          request.template_kwargs(), request_template=request.chat_template)
        max_tokens = request.requested_max_tokens()
        params, [ids] = self._params(request, [ids], max_tokens, logprobs, "messages", prompt_logprobs,
                                     max_tokens is None)
        if tools is not None:
            params = tools.adjust(params)
        await self.compile_grammar(request, params, tools)
        self.check_capacity(1)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        # vLLM logs a chat's prompt as the template rendered it (decoded only when the log is on)
        logged = [self.tokenizer.decode(ids)] if request_log.enabled() else None
        stream = self._merged([ids], params, rid, [None], request.priority, logged)
        if request.stream:
            return self._chat_chunks(rid, stream, params, request.include_usage, request.continuous_usage, tools,
                                     ids, request.return_token_ids, request.echoed())
        finals = {i: out async for i, out in stream if out.finished}
        output = finals[0]
        choices = []
        for c in output.outputs:
            message, finish_reason = (tools.message(c.text, c.finish_reason) if tools is not None else
                                      ({"role": "assistant", "content": c.text}, c.finish_reason))
            if request.echoed():
                message["content"] = request.echoed() + (message["content"] or "")
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(token_pairs(c), params.logprobs, self.token_bytes),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason}
                           | ({"token_ids": list(c.token_ids)} if request.return_token_ids else {}))
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(finals)}
        if request.return_token_ids:  # vLLM's: the prompt's on the reply, each choice's generated ones on it
            body["prompt_token_ids"] = list(output.prompt_token_ids)
        if params.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(output)
        return body

    async def _chat_chunks(self, rid, stream, params: SamplingParams, include_usage: bool, continuous: bool = False,
                           tools: ToolCalling | None = None, prompt_ids: list[int] = (),
                           return_token_ids: bool = False, echoed: str = ""):
        """The chunks of a streamed chat reply, from the engine's delta outputs (with continuous usage,
        the first, the role's, carries the prompt's, as vLLM's; with `return_token_ids`, the first carries
        the prompt's token ids and each later one its choice's new ones, as vLLM's; `echoed` text, one
        chunk per choice after the role's, as vLLM's)."""
        created, prompt_tokens = int(time.time()), len(prompt_ids)
        deltas = DeltaTracker()
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        calls = {i: ToolCallStream(tools) for i in range(params.n)} if tools is not None and tools.reads_calls else {}

        def chunk(choices, usage=None):
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices}
            if include_usage:
                if usage is None and continuous:
                    usage = self._usage(latest, deltas.num_generated) if latest else {
                        "prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
                body["usage"] = usage
            return body

        first = chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(params.n)])
        yield first | ({"prompt_token_ids": list(prompt_ids)} if return_token_ids else {})
        for i in range(params.n if echoed else 0):
            yield chunk([{"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}])
        async for prompt_index, output in stream:
            latest[prompt_index] = output
            for c in output.outputs:
                text, finished = c.text, c.finish_reason is not None
                pairs = deltas.add(c.index, c)
                delta, finish_reason = {"content": text} if text else {}, c.finish_reason
                if c.index in calls:
                    content, tool_deltas = calls[c.index].feed(text, finished, c.finish_reason == "length")
                    delta = {"content": content} if content else {}
                    if tool_deltas:
                        delta["tool_calls"] = tool_deltas
                    finish_reason = calls[c.index].finish_reason(c.finish_reason)
                if not delta and not finished:
                    continue  # (its tokens' logprobs go with the next chunk)
                ids = deltas.token_ids(c.index)
                deltas.sent(c.index)
                yield chunk([{"index": c.index, "delta": delta,
                              "logprobs": chat_logprobs(pairs, params.logprobs, self.token_bytes),
                              "finish_reason": finish_reason if finished else None,
                              "stop_reason": c.stop_reason if finished else None}
                             | ({"token_ids": ids} if return_token_ids else {})])
            if output.finished:
                finals[prompt_index] = output
        if include_usage:
            yield chunk([], self._usage(finals, deltas.num_generated))

    # ---- completions ------------------------------------------------------------------------
    async def completions(self, request: CompletionRequest):
        self.check_model(request.model)
        try:
            logprobs = request.requested_logprobs()
            prompt_logprobs = request.requested_prompt_logprobs()
            max_tokens = request.requested_max_tokens()
            raw_prompts = request.prompts()
        except ValueError as exc:
            raise from_value_error(exc) from exc
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in raw_prompts]
        texts = [p if isinstance(p, str) else None for p in raw_prompts]
        params, prompts = self._params(request, prompts, max_tokens, logprobs, "prompt", prompt_logprobs,
                                       request.max_tokens is None)
        await self.compile_grammar(request, params)
        self.check_capacity(len(prompts))
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = self._merged(prompts, params, rid, texts, request.priority)
        echo = [(t if t is not None else self.tokenizer.decode(p)) if request.echo else "" for t, p in zip(texts, prompts)]
        reply = CompletionReply(request, params, echo, self.tokenizer)
        if request.stream:
            return _sse(self._completion_chunks(rid, stream, reply, request.include_usage, request.continuous_usage))
        finals = {i: out async for i, out in stream if out.finished}
        choices = [reply.choice(i, finals[i], c) for i in range(len(prompts)) for c in finals[i].outputs]
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": reply.usage(self._usage(finals))})

    async def _completion_chunks(self, rid, stream, reply: CompletionReply, include_usage: bool,
                                 continuous: bool = False):
        """The chunks of a streamed completion, from the engine's delta outputs."""
        created = int(time.time())
        deltas = DeltaTracker()
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        async for prompt_index, output in stream:
            latest[prompt_index] = output
            for c in output.outputs:
                key = (prompt_index, c.index)
                first, finished = not deltas.was_sent(key), c.finish_reason is not None
                pairs = deltas.add(key, c)
                if not c.text and not finished and not (first and reply.echo[prompt_index]):
                    continue  # (its tokens' logprobs go with the next chunk)
                ids = deltas.token_ids(key)
                deltas.sent(key)
                body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [reply.chunk_choice(prompt_index, output, c, first, pairs, finished, ids)]}
                if include_usage:
                    body["usage"] = reply.usage(self._usage(latest, deltas.num_generated)) if continuous else None
                yield body
            if output.finished:
                finals[prompt_index] = output
        if include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": reply.usage(self._usage(finals, deltas.num_generated))}


def _raise_a_failed_grammar(output: RequestOutput) -> None:
    """A choice the grammar engine failed in part way (finish_reason "error") fails the reply: its
    text breaks the grammar it was asked to follow, so it is not returned as if it had stopped."""
    failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(400, f"the grammar engine failed part way through the reply ({failed.stop_reason}); "
                            "a grammar this large or ambiguous is beyond its limits: simplify it",
                       code="grammar_failed")


def _chat_request(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _sse(chunks) -> StreamingResponse:
    """The chunks as server-sent events; a failure once the stream has begun is its last event (as
    OpenAI's: an `error` object), then [DONE]: a drain's cut, an engine that failed."""
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {jsonl.line(chunk)}\n\n"
        except Exception as exc:  # (a client gone is GeneratorExit/CancelledError, not caught here)
            yield f"data: {jsonl.line(failure_body(exc))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
