"""OpenAI's Responses API and Anthropic's Messages API, through their official clients (`openai`,
`openai-agents`, `anthropic`), against `treeserve serve` (a tiny model with the Hermes tool template
and parser) and against the gateway in front of it (SQLite): greedy answers equal the chat
completion of the same conversation, streamed equal whole, tool round trips, `previous_response_id`
(per key on the gateway), retrieve and delete, structured text, a two-tool agent run to completion,
errors in Anthropic's shape, and usage billed like chats."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest

from conftest import API_KEY, assert_no_leak, running_server, wait_idle
from treeserve.entrypoints.chat_utils import load_chat_template
from treeserve.gateway.app import build_app as build_gateway
from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig
from treeserve.server.launch import build_app
from treeserve.server.tool_calls import ToolSettings
from treeserve.testing.tiny_models import make_tiny_model

EXAMPLES = Path(__file__).parent.parent / "examples"
MASTER = "sk-master-agents"
IN_PRICE, OUT_PRICE = 1e-6, 1e-3
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [4, 5]}}, "required": ["a", "b"],
       "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
RESPONSE_TOOLS = [{"type": "function", "name": "add", "description": "adds", "parameters": ADD},
                  {"type": "function", "name": "weather", "description": "the weather", "parameters": CITY}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_tiny_model("llama", tmp_path_factory.mktemp("agents") / "llama", seed=3, max_position_embeddings=8192,
                            favour_tokens={"<|eos|>": 2.0})
    template = load_chat_template(str(EXAMPLES / "tool_chat_template_hermes.jinja"))
    app = build_app(str(model), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=128 << 20, max_model_len=8192, chat_template=template,
                    tool_settings=ToolSettings("hermes", auto=True))
    with running_server(app) as url:
        yield SimpleNamespace(url=url, app=app, engine=app.state.engine.engine)


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    database = f"sqlite:///{tmp_path_factory.mktemp('agents-gw') / 'gateway.db'}"
    model = ModelConfig("tiny", [BackendConfig(served.url, api_key=API_KEY)], input_cost_per_token=IN_PRICE,
                        output_cost_per_token=OUT_PRICE)
    app = build_gateway(GatewayConfig(models={"tiny": model}, master_key=MASTER, database=database,
                                      health_interval=0))
    with running_server(app) as url:
        keys = [httpx.post(f"{url}/key/generate", json={}, headers={"Authorization": f"Bearer {MASTER}"}).json()["key"]
                for _ in range(2)]
        yield SimpleNamespace(url=url, app=app, keys=keys)


@pytest.fixture(params=["server", "gateway"])
def target(request, served):
    """Where the clients point: the server itself, or the gateway with a key of its own."""
    if request.param == "server":
        return SimpleNamespace(url=served.url, key=API_KEY, other_key=None)
    gw = request.getfixturevalue("gateway")
    return SimpleNamespace(url=gw.url, key=gw.keys[0], other_key=gw.keys[1])


def _openai(target, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{target.url}/v1", api_key=key or target.key, max_retries=0, timeout=120)


def _anthropic(target) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=target.url, api_key=target.key, max_retries=0, timeout=120)


def _chat_text(served, messages, **params) -> tuple[str, dict]:
    out = _openai(SimpleNamespace(url=served.url, key=API_KEY)).chat.completions.create(
        model="tiny", messages=messages, **params)
    return out.choices[0].message.content or "", out.usage


def test_responses_equal_the_chat_completion_whole_and_streamed(served, target):
    client = _openai(target)
    response = client.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.",
                                       max_output_tokens=12, **GREEDY)
    text, usage = _chat_text(served, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a colour."}], max_tokens=12, **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert response.output_text == text and text
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens
    assert response.status == ("incomplete" if usage.completion_tokens == 12 else "completed")
    with client.responses.stream(model="tiny", instructions="Be brief.", input="Name a colour.",
                                 max_output_tokens=12, **GREEDY) as stream:
        events = [event for event in stream]
    final = events[-1].response  # (cut by max_output_tokens it is response.incomplete, as OpenAI's: no final response)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == ("response.incomplete" if usage.completion_tokens == 12 else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert final.output_text == text and final.usage.output_tokens == usage.completion_tokens


def test_previous_response_id_continues_the_conversation_and_stays_with_its_key(served, target):
    client = _openai(target)
    first = client.responses.create(model="tiny", input="One.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(model="tiny", input="Two.", previous_response_id=first.id, max_output_tokens=6,
                                     **GREEDY)
    text, usage = _chat_text(served, [{"role": "user", "content": "One."},
                                      {"role": "assistant", "content": first.output_text},
                                      {"role": "user", "content": "Two."}], max_tokens=6, **GREEDY)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.status, [(c.type, c.text) for c in i.content]) for i in items.data] == [
        ("message", "user", "completed", [("input_text", "Two.")])]  # (OpenAI's shape: it was the string sent)
    listed = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}]}])
    page = client.responses.input_items.list(listed.id, limit=2)  # (newest first, as OpenAI's)
    assert [i.content[0].text for i in page.data] == ["c", "b"] and page.has_more
    assert page.data[1].content[0].type == "output_text"
    assert [i.content[0].text for i in client.responses.input_items.list(listed.id, limit=1, order="asc")] == \
        ["a", "b", "c"]  # (the client follows `after` page by page)
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(listed.id, limit=101)
    if target.other_key is not None:  # another key of the gateway cannot read, continue or delete it
        other = _openai(target, target.other_key)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError, match="previous_response_id") as caught:
            other.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
        assert caught.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_text_part_without_its_text_is_a_400_naming_its_text(target):
    """A text part that lacks its `text` (or has one that is no string) is named by that field; it was a 400
    saying `input_text` parts are not supported ("only text parts are supported ..., got 'input_text'")."""
    client = _openai(target)
    for part, kind in [({"type": "input_text"}, "input_text"), ({"type": "output_text", "text": 5}, "output_text")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", max_output_tokens=2, input=[
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "input_text", "text": "b"}, part]}])
        assert caught.value.param == "input[1].content[1].text", caught.value.body
        assert "required" in caught.value.message and repr(kind) in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:  # (a call's output given as parts is read alike)
        client.responses.create(model="tiny", max_output_tokens=2, input=[
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text"}]}])
    assert caught.value.param == "input[1].output[0].text", caught.value.body


def test_a_bad_input_items_query_parameter_is_named_as_openai_names_it(target):
    client = _openai(target)
    response = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:  # (it was `query.order`: FastAPI's location of it)
        client.responses.input_items.list(response.id, order="sideways")
    assert caught.value.param == "order" and caught.value.body["message"].startswith("order: "), caught.value.body


def test_an_unknown_previous_response_id_is_openais_400_previous_response_not_found(target):
    """OpenAI answers a `previous_response_id` it does not hold (never stored, deleted) with a 400 whose code,
    `previous_response_not_found`, clients act on by sending the whole conversation again (it was a 404
    `response_not_found`, which they take for a wrong model or route); a retrieve of it stays a 404."""
    client = _openai(target)
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    deleted = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    client.responses.delete(deleted.id)
    for missing in (unstored.id, deleted.id, "resp_nope"):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model="tiny", input="y", previous_response_id=missing, max_output_tokens=2,
                                        stream=stream)
            assert (caught.value.code, caught.value.param) == ("previous_response_not_found", "previous_response_id")
            assert missing in caught.value.message
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)


def test_a_tool_round_trip_whole_and_streamed(served, target):
    client = _openai(target)
    for choice in ("required", {"type": "function", "name": "weather"}):
        response = client.responses.create(model="tiny", input="Weather in Oslo, then add.", tools=RESPONSE_TOOLS,
                                           tool_choice=choice, parallel_tool_calls=False, max_output_tokens=60,
                                           **GREEDY)
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].status == "completed"
        schema = ADD if calls[0].name == "add" else CITY
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        answer = client.responses.create(model="tiny", previous_response_id=response.id, max_output_tokens=8,
                                         input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                 "output": "sunny"}], **GREEDY)
        text, _ = _chat_text(served, [{"role": "user", "content": "Weather in Oslo, then add."},
                                      {"role": "assistant", "content": None, "tool_calls": [
                                          {"id": calls[0].call_id, "type": "function",
                                           "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
                                      {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}],
                             max_tokens=8, **GREEDY)
        assert answer.output_text == text
    with client.responses.stream(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), ADD if call.name == "add" else CITY)


def test_text_format_json_schema_is_followed(target):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    response = _openai(target).responses.create(
        model="tiny", input="A colour as JSON.", max_output_tokens=40, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_what_cannot_be_served_is_a_400_naming_it(target):
    client = _openai(target)
    cases = [({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": "x", "background": True}, "background"),
             ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
              "input[0].content[0].type")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", max_output_tokens=2, **body)
        assert caught.value.body["param"] == param, caught.value.body
    # a field OpenAI does not know is named, as OpenAI's (before: ignored; `max_tokens` ran to the model's length)
    for extra, param, code in [({"max_tokens": 3}, "max_tokens", "unknown_parameter"),
                               ({"max_output_token": 3}, "max_output_token", "unknown_parameter"),
                               ({"temperature": 5.0}, "temperature", None), ({"top_logprobs": 2}, "top_logprobs", None)]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param and (code is None or caught.value.body["code"] == code), \
            caught.value.body
    # the chat's errors name the fields this API has (they named max_tokens, response_format, messages)
    schema_format = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "bogus"}}}
    for extra, param in [({"max_output_tokens": 10 ** 9}, "max_output_tokens"), ({"text": schema_format}, "text.format"),
                         ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
                         ({"input": []}, "input"),
                         ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
                          "tool_choice.name")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", **({"input": "x", "max_output_tokens": 2} | extra))
        assert caught.value.body["param"].startswith(param), (param, caught.value.body)
        assert caught.value.body["message"].startswith(param), caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:  # a field named inside the message is this API's too
        client.responses.create(model="tiny", input="x", max_output_tokens=2, tools=[{"type": "function", "name": "f"}],
                                tool_choice="required", text={"format": {"type": "json_object"}})
    assert "text.format cannot" in caught.value.body["message"], caught.value.body
    taken = client.responses.create(model="tiny", input="x", max_output_tokens=2, service_tier="auto",
                                    prompt_cache_key="k", safety_identifier="u1", max_tool_calls=2, top_logprobs=0)
    assert taken.status in ("completed", "incomplete")


def test_an_openai_agents_two_tool_agent_runs_to_completion(served, target):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, RunHooks, function_tool,
                        set_tracing_disabled)
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def add(a: Literal[1, 2, 3], b: Literal[4, 5]) -> int:
        """Adds two numbers."""
        called.append("add")
        return a + b

    @function_tool
    def weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        called.append("weather")
        return f"sunny in {city}"

    def both_called(context, results):
        from agents.agent import ToolsToFinalOutputResult
        if {"add", "weather"} <= set(called):
            return ToolsToFinalOutputResult(is_final_output=True,
                                            final_output="; ".join(str(r.output) for r in results))
        return ToolsToFinalOutputResult(is_final_output=False)

    class NextTool(RunHooks):
        """After each call the agent must call the other tool (a random model would not choose)."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings,
                                                       tool_choice="weather" if tool.name == "add" else "add")

    client = openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=target.key, max_retries=0, timeout=120)
    agent = Agent(name="two tools", instructions="Use the tools.", tools=[add, weather],
                  model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="add", temperature=1.0, max_tokens=200,
                                               extra_body={"seed": 7}),
                  tool_use_behavior=both_called, reset_tool_choice=False)
    result = asyncio.run(Runner.run(agent, "Add 1 and 4, and tell me the weather in Oslo.", max_turns=6,
                                    hooks=NextTool(), run_config=RunConfig(tracing_disabled=True)))
    assert called == ["add", "weather"] and "sunny in" in result.final_output, (called, result.final_output)
    assert sum(r.usage.requests for r in result.raw_responses) == len(result.raw_responses) >= 2
    wait_idle(served.engine)
    assert_no_leak(served.engine)


def test_anthropic_messages_whole_streamed_tools_and_count_tokens(served, target):
    client = _anthropic(target)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    message = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=messages,
                                     extra_body=GREEDY)
    text, usage = _chat_text(served, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a colour."}], max_tokens=12, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].text == text and text
    assert message.stop_reason == ("max_tokens" if usage.completion_tokens == 12 else "end_turn")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == usage.prompt_tokens
    assert message.usage.output_tokens == usage.completion_tokens
    with client.messages.stream(model="tiny", max_tokens=12, system="Be brief.", messages=messages,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    opened = events[0].message.usage  # (the prompt's tokens known from the start, as Anthropic's; they were 0)
    assert opened.input_tokens + opened.cache_read_input_tokens == usage.prompt_tokens and opened.output_tokens == 0
    # (the prompt, cached by the whole request before, is counted alike at the start and the end; message_start
    # said all of it was input_tokens, none cache_read_input_tokens, and message_delta then said otherwise)
    assert final.usage.cache_read_input_tokens > 0
    assert (opened.input_tokens, opened.cache_read_input_tokens) == (final.usage.input_tokens,
                                                                     final.usage.cache_read_input_tokens)
    assert final.content[0].text == text and final.usage.output_tokens == usage.completion_tokens
    raw = client.messages.with_raw_response.count_tokens(model="tiny", system="Be brief.", messages=messages)
    assert raw.parse().input_tokens == usage.prompt_tokens
    if target.other_key is not None:  # the gateway: its answers carry the request id it logs them under
        assert raw.headers.get("x-request-id")
    tools = [{"name": "weather", "description": "the weather", "input_schema": CITY}]
    call = client.messages.create(model="tiny", max_tokens=60, messages=[{"role": "user", "content": "Weather?"}],
                                  tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert call.stop_reason == "tool_use"
    named = dict(model="tiny", max_tokens=60, messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                 tool_choice={"type": "tool", "name": "weather"})  # (its chat ends "stop", as OpenAI's)
    assert client.messages.create(**named).stop_reason == "tool_use"
    with client.messages.stream(**named) as stream:
        assert stream.get_final_message().stop_reason == "tool_use"
    use = next(block for block in call.content if block.type == "tool_use")
    jsonschema.validate(use.input, CITY)
    answer = client.messages.create(model="tiny", max_tokens=8, tools=tools, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": call.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    text, _ = _chat_text(served, [{"role": "user", "content": "Weather?"},
                                  {"role": "assistant", "content": None, "tool_calls": [
                                      {"id": use.id, "type": "function",
                                       "function": {"name": "weather", "arguments": json.dumps(use.input)}}]},
                                  {"role": "tool", "tool_call_id": use.id, "content": "sunny"}],
                         tools=[{"type": "function", "function": {"name": "weather", "description": "the weather",
                                                                   "parameters": CITY}}], max_tokens=8, **GREEDY)
    assert "".join(b.text for b in answer.content if b.type == "text") == text
    # a prefill (a final assistant message) is continued, as Anthropic's; before, a new turn began after it
    prefill = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "It is"}]
    continued = client.messages.create(model="tiny", max_tokens=6, messages=prefill, extra_body=GREEDY)
    text, usage = _chat_text(served, prefill, max_tokens=6, **GREEDY,
                             extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.content[0].text == text and continued.usage.output_tokens == usage.completion_tokens
    rendered = httpx.post(f"{served.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "model": "tiny", "messages": prefill, "add_generation_prompt": False, "continue_final_message": True}).json()
    as_a_turn = httpx.post(f"{served.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "model": "tiny", "messages": prefill}).json()
    assert usage.prompt_tokens == rendered["count"] < as_a_turn["count"]  # (no end of turn, no new header)
    assert as_a_turn["tokens"][:rendered["count"]] == rendered["tokens"]
    for bad in ({"continue_final_message": True}, {"add_generation_prompt": False, "continue_final_message": True,
                                                   "messages": prefill[:1]}):
        with pytest.raises(openai.BadRequestError) as caught:
            _openai(SimpleNamespace(url=served.url, key=API_KEY)).chat.completions.create(
                model="tiny", messages=bad.pop("messages", prefill), max_tokens=2, extra_body=bad)
        assert caught.value.body["param"] == "continue_final_message"
    # a stop sequence met: named, whole and streamed (before, a stream said end_turn)
    colour = final.content[0].text
    sequence = colour[-2:]
    kept = colour[:colour.index(sequence)]
    stopped = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=messages,
                                     stop_sequences=[sequence], extra_body=GREEDY)
    with client.messages.stream(model="tiny", max_tokens=12, system="Be brief.", messages=messages,
                                stop_sequences=[sequence], extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    for reply in (stopped, streamed):
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", sequence), reply
        assert "".join(b.text for b in reply.content if b.type == "text") == kept


def test_anthropic_errors_come_in_its_shape(target):
    client = _anthropic(target)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    for call, extra in [(client.messages.create, {"stop": ["="]}), (client.messages.count_tokens, {"max_tokens": 3})]:
        with pytest.raises(anthropic.BadRequestError) as caught:  # (fields Anthropic does not know: named, as its)
            call(model="tiny", messages=[{"role": "user", "content": "x"}], extra_body=extra,
                 **({"max_tokens": 2} if call == client.messages.create else {}))
        assert caught.value.body["error"]["message"] == f"{next(iter(extra))}: unknown parameter"
    with pytest.raises(anthropic.BadRequestError) as caught:  # (named as sent: it was tools[0].function.parameters)
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                               tools=[{"name": "f", "input_schema": "str"}])
    assert caught.value.body["error"]["message"].startswith("tools[0].input_schema"), caught.value.body
    bad_key = anthropic.Anthropic(base_url=target.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad_key.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_the_gateway_bills_responses_and_messages_like_chats(gateway):
    key = gateway.keys[1]
    target = SimpleNamespace(url=gateway.url, key=key)
    raw = _openai(target).responses.with_raw_response.create(model="tiny", input="Bill me.", max_output_tokens=5,
                                                             **GREEDY)
    response = raw.parse()
    raw_message = _anthropic(target).messages.with_raw_response.create(
        model="tiny", max_tokens=5, extra_body=GREEDY, messages=[{"role": "user", "content": "Bill me too."}])
    message = raw_message.parse()
    with _anthropic(target).messages.stream(model="tiny", max_tokens=5, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": "And a stream."}]) as stream:
        streamed = stream.get_final_message()
        stream_id = stream.response.headers["x-request-id"]
    # each answer carries the request id of its spend_logs row, as a relayed chat's does
    expected = {raw.headers["x-request-id"]: (response.usage.input_tokens, response.usage.output_tokens),
                raw_message.headers["x-request-id"]: (message.usage.input_tokens + message.usage.cache_read_input_tokens,
                                                      message.usage.output_tokens),
                stream_id: (streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens,
                            streamed.usage.output_tokens)}
    logs = httpx.get(f"{gateway.url}/spend/logs", params={"api_key": key},
                     headers={"Authorization": f"Bearer {MASTER}"}).json()  # (the ledger is flushed first)
    assert {row["request_id"]: (row["prompt_tokens"], row["completion_tokens"]) for row in logs} == expected
    for row in logs:
        assert row["route"] == "chat" and row["status"] == "success"
        assert row["cost"] == pytest.approx(row["prompt_tokens"] * IN_PRICE + row["completion_tokens"] * OUT_PRICE)


def test_an_output_item_cut_by_max_output_tokens_is_incomplete(target):
    """As OpenAI's: the response and the item it was writing are `incomplete` (the item said
    `completed`, whole, streamed and retrieved)."""
    client = _openai(target)
    whole = client.responses.create(model="tiny", input="Name a colour.", max_output_tokens=2, **GREEDY)
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [item.status for item in whole.output] == ["incomplete"]
    assert client.responses.retrieve(whole.id).output[-1].status == "incomplete"
    with client.responses.stream(model="tiny", input="Name a colour.", max_output_tokens=2, **GREEDY) as stream:
        events = list(stream)
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [item.status for item in done] == ["incomplete"]
    assert events[-1].type == "response.incomplete" and events[-1].response.output[-1].status == "incomplete"
    # a whole reply's items stay completed
    named = client.responses.create(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "weather"}, **GREEDY)
    assert named.status == "completed" and [item.status for item in named.output] == ["completed"]


def test_anthropic_structured_outputs_and_the_fields_taken_with_no_effect(target):
    """`messages.parse(output_format=...)` (`output_config.format`) follows the schema through the grammar
    engine; `cache_control` (automatic caching: the prefix cache is always on), `inference_geo`, `speed`
    and the Responses API's `prompt_cache_retention` are taken (each was a 400 "unknown parameter")."""
    import pydantic

    class Colour(pydantic.BaseModel):
        colour: Literal["red", "blue"]

    client = _anthropic(target)
    messages = [{"role": "user", "content": "A colour as JSON."}]
    parsed = client.messages.parse(model="tiny", max_tokens=40, messages=messages, output_format=Colour,
                                   speed="standard", extra_body={"temperature": 1.0})
    assert parsed.parsed_output.colour in ("red", "blue") and parsed.stop_reason == "end_turn", parsed
    cached = client.messages.create(model="tiny", max_tokens=2, messages=messages, cache_control={"type": "ephemeral"},
                                    inference_geo="us", speed="fast")
    assert cached.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model="tiny", messages=messages, output_format=Colour,
                                           cache_control={"type": "ephemeral"})
    assert counted.input_tokens == parsed.usage.input_tokens + parsed.usage.cache_read_input_tokens
    for config, param in [({"effort": "low"}, "output_config.effort"),
                          ({"format": {"type": "json_schema", "schema": "x"}}, "output_config.format"),
                          ({"format": {"type": "json_schema", "schema": {"type": "bogus"}}}, "output_config.format")]:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="tiny", max_tokens=2, messages=messages, output_config=config)
        assert caught.value.body["error"]["message"].startswith(param), caught.value.body
    taken = _openai(target).responses.create(model="tiny", input="x", max_output_tokens=2, prompt_cache_retention="24h")
    assert taken.status in ("completed", "incomplete")


def test_an_unknown_route_under_messages_answers_in_anthropics_shape(target):
    """`client.messages.batches` (not served): a 404 in Anthropic's shape on the server too (it was OpenAI's)."""
    with pytest.raises(anthropic.NotFoundError) as caught:
        _anthropic(target).messages.batches.create(requests=[{"custom_id": "a", "params": {
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    missing = httpx.get(f"{target.url}/v1/no-such-route", headers={"Authorization": f"Bearer {target.key}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"  # (OpenAI's elsewhere)


def test_responses_input_tokens_count_what_a_response_is_charged(target):
    """`client.responses.input_tokens.count` (POST /v1/responses/input_tokens, the Responses API's
    count_tokens): the input tokens a response of the same fields is charged, after a previous response
    too (it was a 404 on the server and a 405 on the gateway)."""
    client = _openai(target)
    fields = dict(model="tiny", instructions="Be brief.", input="Weather in Oslo?", tools=RESPONSE_TOOLS,
                  tool_choice={"type": "function", "name": "weather"})
    counted = client.responses.input_tokens.count(**fields)
    response = client.responses.create(max_output_tokens=60, **fields, **GREEDY)
    assert counted.object == "response.input_tokens" and counted.input_tokens == response.usage.input_tokens
    call = response.output[-1]
    follow = dict(model="tiny", previous_response_id=response.id, tools=RESPONSE_TOOLS,
                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert client.responses.input_tokens.count(**follow).input_tokens == \
        client.responses.create(max_output_tokens=2, **follow).usage.input_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_tokens.count(model="tiny", input="x", previous_response_id="resp_nope")
    assert caught.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:  # (arguments sent back that are not JSON: a 400, not a 500)
        client.responses.input_tokens.count(model="tiny", input=[
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{not json"},
            {"type": "function_call_output", "call_id": "c1", "output": "5"}])
    assert caught.value.body["param"].startswith("input"), caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_tokens.count(model="tiny", input="x", extra_body={"max_output_tokens": 3})
    assert caught.value.body["param"] == "max_output_tokens" and caught.value.body["code"] == "unknown_parameter"


def test_anthropics_tool_runner_runs_its_tools(target):
    """`client.beta.messages.tool_runner`, Anthropic's agent loop, asks for a server-held thread; refused as
    `thread_unsupported_request` (`error.details.error_code`), it sends the whole conversation instead and
    runs (before: a 400 "thread: unknown parameter" that ended the run)."""
    from anthropic import beta_tool

    called: list[str] = []

    @beta_tool
    def weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    client = _anthropic(target)
    runner = client.beta.messages.tool_runner(model="tiny", max_tokens=60, tools=[weather], max_iterations=2,
                                              tool_choice={"type": "any"}, extra_body=GREEDY,
                                              messages=[{"role": "user", "content": "Weather in Oslo?"}])
    replies = list(runner)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"] and len(called) == 2, replies
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.beta.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                    thread={"type": "create"})
    assert caught.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}
    assert caught.value.body["error"]["message"].startswith("thread:")


def test_every_object_and_event_validates_against_the_clients_types(target):
    """Strictly, as the clients' pydantic models declare them (the clients build them leniently, so a
    missing field reads None where an int is declared): `usage.input_tokens_details.cache_write_tokens`
    was missing from every response."""
    import pydantic
    from anthropic.types import Message, RawMessageStreamEvent
    from openai.types.responses import Response, ResponseStreamEvent

    headers = {"Authorization": f"Bearer {target.key}"}
    body = {"model": "tiny", "input": "Weather?", "max_output_tokens": 60, "tools": RESPONSE_TOOLS,
            "tool_choice": "required", "temperature": 0.0}
    whole = httpx.post(f"{target.url}/v1/responses", json=body, headers=headers, timeout=120).json()
    Response.model_validate(whole)
    assert whole["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    events = pydantic.TypeAdapter(ResponseStreamEvent)
    for events_of, payload, path in [(events, body | {"stream": True}, "/v1/responses"),
                                     (events, {"model": "tiny", "input": "x", "max_output_tokens": 3, "stream": True},
                                      "/v1/responses")]:
        with httpx.stream("POST", f"{target.url}{path}", json=payload, headers=headers, timeout=120) as stream:
            lines = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1]["type"] in ("response.completed", "response.incomplete")
        for line in lines:
            events_of.validate_python(line)
    messages = {"model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": "Weather?"}],
                "tools": [{"name": "weather", "input_schema": CITY}], "tool_choice": {"type": "any"}}
    Message.model_validate(httpx.post(f"{target.url}/v1/messages", json=messages, headers=headers, timeout=120).json())
    with httpx.stream("POST", f"{target.url}/v1/messages", json=messages | {"stream": True}, headers=headers,
                      timeout=120) as stream:
        lines = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    for line in lines:
        if line["type"] != "ping":
            adapter.validate_python(line)


def test_a_failed_stream_has_an_error_code_openais_types_allow():
    """A stream broken off part way (a grammar the engine fails on, a backend cut) ends `response.failed`
    with a code of OpenAI's list, treeserve's own in the message (it was `grammar_failed`, which the
    client's ResponseError does not allow)."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    from treeserve.wire.responses import ResponsesRequest, skeleton
    from treeserve.wire.responses_stream import ResponseEvents

    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for status, code, expected in [(400, "grammar_failed", "server_error"), (502, "backend_stream_cut", "server_error"),
                                   (429, "queue_full", "rate_limit_exceeded"), (500, None, "server_error"),
                                   (500, "server_error", "server_error")]:
        events = ResponseEvents(skeleton(ResponsesRequest(input="x"), "resp_1", "tiny"))
        sent = events.start(None) + events.feed({"choices": [{"index": 0, "delta": {"content": "a"}}]})
        sent += events.fail(status, "it broke", code)
        for event in sent:
            adapter.validate_python(event)
        error = sent[-1]["response"]["error"]
        assert sent[-1]["type"] == "response.failed" and error["code"] == expected, error
        assert error["message"] == ("it broke" if code in (None, expected) else f"it broke ({code})")
        assert [item["type"] for item in sent[-1]["response"]["output"]] == ["message"]


def test_the_gateway_asks_every_body_for_its_model(gateway):
    """A server defaults a chat's, completion's or score's `model` (vLLM's bodies may leave it out); the
    gateway routes by it: a 400 naming it, and its /openapi.json requires it (before: the rewards and
    Responses bodies' schemas, a server's, called it optional)."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"}), ("/v1/rewards", {"question": "q", "steps": ["a"]})):
        refused = httpx.post(f"{gateway.url}{path}", json=body, headers={"Authorization": f"Bearer {gateway.keys[0]}"},
                             timeout=30)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert error["param"] == "model" and error["code"] == "missing_required_parameter", (path, error)
    schema = httpx.get(f"{gateway.url}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/search", "/v1/rewards", "/v1/responses",
                 "/v1/responses/input_tokens", "/v1/messages", "/v1/messages/count_tokens"):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert "model" in body["required"] and body["properties"]["model"]["type"] == "string", (path, body)


def test_the_gateway_asks_a_responses_body_for_its_model(gateway):
    """The gateway routes by `model`: a Responses body or a token count without one is a 400 naming it."""
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        refused = httpx.post(f"{gateway.url}{path}", json={"input": "x"},
                             headers={"Authorization": f"Bearer {gateway.keys[0]}"}, timeout=30)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert error["param"] == "model" and error["code"] == "missing_required_parameter", (path, error)


def test_truncation_auto_drops_the_oldest_items_to_fit_the_context(served, target, caplog):
    """`truncation: "auto"` (OpenAI's): a conversation past the context (8192 here) loses its oldest
    items, never the instructions, and the answer is the chat completion of what is left; the drop is
    logged. "disabled" (the default), or a last item that alone cannot fit, is the context-length 400
    (before: "auto" was taken and did nothing, the 400 either way)."""
    client = _openai(target)
    long = " ".join(["apple"] * 1000)
    per_item = client.responses.input_tokens.count(model="tiny", input=long).input_tokens
    assert 2800 < per_item < 4000, per_item  # (two fit, three do not)
    items = [{"role": "user", "content": long}, {"role": "assistant", "content": "Yes."},
             {"role": "user", "content": long}, {"role": "assistant", "content": "Yes."},
             {"role": "user", "content": long}, {"role": "user", "content": "Name a colour."}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", instructions="Be brief.", input=items, max_output_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded", caught.value.body
    with caplog.at_level("INFO", logger="treeserve.responses"):
        response = client.responses.create(model="tiny", instructions="Be brief.", input=items, max_output_tokens=4,
                                           truncation="auto", **GREEDY)
    assert response.truncation == "auto"
    kept = [{"role": "system", "content": "Be brief."}] + items[2:]
    text, usage = _chat_text(served, kept, max_tokens=4, **GREEDY)
    assert response.output_text == text and response.usage.input_tokens == usage.prompt_tokens
    assert any("dropped the 2 oldest messages" in r.getMessage() for r in caplog.records), caplog.records
    with client.responses.stream(model="tiny", instructions="Be brief.", input=items, max_output_tokens=4,
                                 truncation="auto", **GREEDY) as stream:
        assert [event for event in stream][-1].response.output_text == text
    with pytest.raises(openai.BadRequestError) as caught:  # the last item alone is too long: still the 400
        client.responses.create(model="tiny", input=items[:1] + [{"role": "user", "content": " ".join([long] * 3)}],
                                max_output_tokens=4, truncation="auto")
    assert caught.value.body["code"] == "context_length_exceeded", caught.value.body


def test_truncation_auto_on_the_gateway_sends_two_chats_on_the_key_however_many_turns_go(gateway):
    """Each chat the gateway sends is a request on the key (its rpm_limit, a spend_logs row): "auto"
    sent one per turn it dropped, so a key with rpm_limit 2 got a 429 for one response whose
    conversation had to lose two turns. The turns to drop are counted (the backend's /tokenize, unbilled)."""
    key = httpx.post(f"{gateway.url}/key/generate", json={"rpm_limit": 2},
                     headers={"Authorization": f"Bearer {MASTER}"}).json()["key"]
    long = " ".join(["apple"] * 1000)
    items = [item for _ in range(5) for item in ({"role": "user", "content": long}, {"role": "assistant", "content": "Yes."})]
    items += [{"role": "user", "content": "Name a colour."}]  # (two of the five long turns fit: three go)
    response = _openai(SimpleNamespace(url=gateway.url), key).responses.create(
        model="tiny", instructions="Be brief.", input=items, max_output_tokens=4, truncation="auto", **GREEDY)
    assert response.truncation == "auto" and response.usage.input_tokens < 8192


def test_truncation_auto_on_the_gateway_sends_one_chat_on_the_key(gateway):
    """The turns that cannot fit are counted before the chat is sent (the backend's /tokenize says the
    context's size, `max_model_len`), so a key with rpm_limit 1 gets its response (before: the chat
    was sent, refused, then sent again: a 429 on the second)."""
    key = httpx.post(f"{gateway.url}/key/generate", json={"rpm_limit": 1},
                     headers={"Authorization": f"Bearer {MASTER}"}).json()["key"]
    long = " ".join(["apple"] * 1000)
    items = [item for _ in range(4) for item in ({"role": "user", "content": long}, {"role": "assistant", "content": "Yes."})]
    items += [{"role": "user", "content": "Name a colour."}]
    response = _openai(SimpleNamespace(url=gateway.url), key).responses.create(
        model="tiny", instructions="Be brief.", input=items, max_output_tokens=4, truncation="auto", **GREEDY)
    assert response.truncation == "auto" and 5600 < response.usage.input_tokens < 8192


def test_responses_input_tokens_apply_truncation(served, target):
    """`client.responses.input_tokens.count` takes `truncation` as a response does (OpenAI's reference):
    with "auto", the count of what is left once the oldest turns go (what the response is charged);
    with "disabled" (the default), an input past the context is the response's context-length 400.
    Before: the whole input was counted either way."""
    client = _openai(target)
    long = " ".join(["apple"] * 1000)
    items = [{"role": "user", "content": long}, {"role": "assistant", "content": "Yes."},
             {"role": "user", "content": long}, {"role": "assistant", "content": "Yes."},
             {"role": "user", "content": long}, {"role": "user", "content": "Name a colour."}]
    counted = client.responses.input_tokens.count(model="tiny", instructions="Be brief.", input=items,
                                                  truncation="auto")
    response = client.responses.create(model="tiny", instructions="Be brief.", input=items, max_output_tokens=2,
                                       truncation="auto", **GREEDY)
    assert counted.input_tokens == response.usage.input_tokens < 8192
    for truncation in ("disabled", None):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.input_tokens.count(model="tiny", instructions="Be brief.", input=items,
                                                **({"truncation": truncation} if truncation else {}))
        assert (caught.value.body["code"], caught.value.body["param"]) == ("context_length_exceeded", "input"), \
            caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:  # the last item alone is too long, "auto" or not
        client.responses.input_tokens.count(model="tiny", input=[{"role": "user", "content": " ".join([long] * 3)}],
                                            truncation="auto")
    assert caught.value.body["code"] == "context_length_exceeded", caught.value.body
    assert client.responses.input_tokens.count(model="tiny", input=items[-1:], truncation="auto").input_tokens == \
        client.responses.input_tokens.count(model="tiny", input=items[-1:]).input_tokens


def test_responses_allowed_tools_restrict_the_calls(target):
    """The Responses API's `tool_choice: {"type": "allowed_tools", "mode", "tools"}`, as chat completions'
    (the model calls only those); a name that is not a tool is a 400 naming it in the Responses
    request's terms. Before: a 400 for the form itself."""
    client = _openai(target)
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "weather"}]}
    response = client.responses.create(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, tool_choice=choice,
                                       max_output_tokens=60, **GREEDY)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and {call.name for call in calls} == {"weather"}, response.output
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, max_output_tokens=4,
                                tool_choice=choice | {"tools": [{"type": "function", "name": "fly"}]})
    assert caught.value.body["param"] == "tool_choice.tools[0].name", caught.value.body


def test_responses_input_tokens_count_only_the_allowed_tools(target):
    """An allowed_tools choice shows the model only the tools it names, so the input tokens counted
    (`input_tokens.count`, and `truncation: "auto"`'s counts) are those of a prompt with those only, on
    the gateway as on the server. Before: the gateway's count (a backend's /tokenize, which takes no
    tool_choice) rendered every tool, more than the response is charged."""
    client = _openai(target)
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "weather"}]}
    counted = client.responses.input_tokens.count(model="tiny", input="Weather?", tools=RESPONSE_TOOLS,
                                                  tool_choice=choice).input_tokens
    response = client.responses.create(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, tool_choice=choice,
                                       max_output_tokens=1, **GREEDY)
    every = client.responses.input_tokens.count(model="tiny", input="Weather?", tools=RESPONSE_TOOLS).input_tokens
    assert counted == response.usage.input_tokens < every


def test_fields_the_vendors_define_and_treeserve_does_not_are_told_apart_from_unknown_ones(target):
    """A Responses or Messages field the vendor defines and treeserve does not implement is a 400 naming
    it that says so (code unsupported_parameter); a misspelt one stays `unknown parameter` (before:
    both read `unknown parameter`, as if the client had made a typo). Sent empty, such a field is taken."""
    client = _openai(target)
    for extra in [{"context_management": [{"type": "compaction"}]}, {"background": True}, {"prompt": {"id": "p"}},
                  {"include": ["message.output_text.logprobs"]}, {"reasoning": {"effort": "high"}}]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body=extra)
        name = next(iter(extra))
        assert caught.value.body["param"] == name and caught.value.body["code"] == "unsupported_parameter", \
            caught.value.body
        assert caught.value.body["message"].startswith(f"{name}: not supported by treeserve"), caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body={"backgroud": True})
    assert caught.value.body["message"] == "backgroud: unknown parameter", caught.value.body
    taken = client.responses.create(model="tiny", input="x", max_output_tokens=2, background=False, include=[],
                                    reasoning={"effort": "minimal"})
    assert taken.status in ("completed", "incomplete")
    messages = _anthropic(target)
    for extra in [{"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
                  {"container": "container_1"}, {"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}]:
        name = next(iter(extra))
        for call in (messages.messages.create, messages.messages.count_tokens):
            with pytest.raises(anthropic.BadRequestError) as caught:
                call(model="tiny", messages=[{"role": "user", "content": "x"}], extra_body=extra,
                     **({"max_tokens": 2} if call == messages.messages.create else {}))
            assert caught.value.body["error"]["message"].startswith(f"{name}: not supported by treeserve"), \
                caught.value.body
    with pytest.raises(anthropic.BadRequestError) as caught:
        messages.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                 extra_body={"mcp_server": []})
    assert caught.value.body["error"]["message"] == "mcp_server: unknown parameter", caught.value.body


def test_a_count_the_gateway_refuses_carries_its_logged_request_id(gateway, caplog):
    """A token count the gateway refuses (`messages.count_tokens`, `responses.input_tokens.count` of a model
    it does not serve) is refused as a request is: logged with its id, which the answer carries as
    `x-request-id` (and, on Anthropic's route, `request-id`); before, neither, and it was not logged."""
    target = SimpleNamespace(url=gateway.url, key=gateway.keys[0])
    with caplog.at_level("INFO", logger="treeserve.gateway"):
        with pytest.raises(anthropic.NotFoundError) as caught:
            _anthropic(target).messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])
        anthropics = caught.value.request_id
        assert caught.value.response.headers.get("x-request-id") == anthropics
        with pytest.raises(openai.NotFoundError) as caught:
            _openai(target).responses.input_tokens.count(model="nope", input="x")
        openais = caught.value.response.headers.get("x-request-id")
    assert anthropics and openais and openais != anthropics
    logged = [record.getMessage() for record in caplog.records if record.name == "treeserve.gateway"]
    for request_id in (anthropics, openais):
        assert any(line.startswith(f"{request_id} tokenize") and "refused 404" in line for line in logged), logged


def test_anthropic_answers_carry_a_request_id(target):
    """Every answer on Anthropic's routes carries `request-id` (its clients' `_request_id`, an error's
    `request_id`), and an error body its `request_id`, as Anthropic's; on the gateway it is the
    answer's `x-request-id` (its spend_logs row's). Before: no `request-id` at all."""
    client = _anthropic(target)
    ask = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    raw = client.messages.with_raw_response.create(**ask)
    message = raw.parse()
    assert raw.headers["request-id"] and message._request_id == raw.headers["request-id"]
    if target.other_key:
        assert raw.headers["request-id"] == raw.headers["x-request-id"]
    with client.messages.stream(**ask) as stream:
        assert stream.response.headers["request-id"]
        stream.get_final_message()
    assert client.messages.with_raw_response.count_tokens(model="tiny", messages=ask["messages"]).headers["request-id"]
    ids = set()
    for call in (lambda: client.messages.create(**(ask | {"max_tokens": 0})),
                 lambda: client.messages.create(**ask, extra_body={"nope": 1}),
                 lambda: anthropic.Anthropic(base_url=target.url, api_key="sk-wrong", max_retries=0).messages.create(
                     **ask)):
        with pytest.raises(anthropic.APIStatusError) as caught:
            call()
        assert caught.value.request_id and caught.value.body["request_id"] == caught.value.request_id, \
            caught.value.body
        ids.add(caught.value.request_id)
    assert len(ids) == 3
    assert "request-id" not in httpx.get(f"{target.url}/v1/models",
                                         headers={"Authorization": f"Bearer {target.key}"}).headers


# ---- the Conversations API, and the Responses API's `conversation` ---------------------------------
def test_conversations_and_their_items_through_the_openai_client(target):
    """`client.conversations` (before: 404 route not found): create with items and metadata, retrieve,
    update, delete; items listed a page at a time (newest first unless asc), added, retrieved and
    deleted; a bad item is a 400 naming it; another key of the gateway finds none of it."""
    client = _openai(target)
    conversation = client.conversations.create(metadata={"topic": "t"}, items=[
        {"role": "user", "content": "a"}, {"type": "message", "role": "assistant", "content": "b"}])
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "t"}
    assert client.conversations.retrieve(conversation.id).created_at == conversation.created_at
    assert client.conversations.update(conversation.id, metadata={"topic": "u"}).metadata == {"topic": "u"}
    added = client.conversations.items.create(conversation.id, items=[
        {"role": "user", "content": [{"type": "input_text", "text": "c"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"}])
    assert [item.type for item in added.data] == ["message", "function_call", "function_call_output"]
    texts = [(i.type, i.content[0].text if i.type == "message" else i.call_id)
             for i in client.conversations.items.list(conversation.id, order="asc", limit=2)]  # (page by page)
    assert texts == [("message", "a"), ("message", "b"), ("message", "c"), ("function_call", "c1"),
                     ("function_call_output", "c1")]
    newest = client.conversations.items.list(conversation.id, limit=2)
    assert [i.type for i in newest.data] == ["function_call_output", "function_call"] and newest.has_more
    item = client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    assert item.id == added.data[0].id and item.content[0].text == "c" and item.role == "user"
    assert client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id).id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    for bad, param in [([{"role": "wizard", "content": "x"}], "items[0].role"),
                       ([{"role": "user", "content": "x"}, {"type": "input_image"}], "items[1].type"),
                       ([{"role": "user", "content": "x", "id": added.data[1].id}], "items[0].id"),
                       ([{"role": "user", "content": "x"}] * 21, "items")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.conversations.items.create(conversation.id, items=bad)
        assert caught.value.param == param, caught.value.body
    for metadata, param in [({f"k{i}": "v" for i in range(17)}, "metadata"), ({"k": "v" * 513}, "metadata.k")]:
        with pytest.raises(openai.BadRequestError) as caught:  # (OpenAI's bounds: 16 pairs, values of 512)
            client.conversations.create(metadata=metadata)
        assert caught.value.param == param, caught.value.body
    if target.other_key is not None:
        other = _openai(target, target.other_key)
        for call in (lambda: other.conversations.retrieve(conversation.id),
                     lambda: other.conversations.items.list(conversation.id),
                     lambda: other.conversations.items.create(conversation.id, items=[{"role": "user", "content": "x"}]),
                     lambda: other.conversations.delete(conversation.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


def test_a_response_in_a_conversation_continues_it_and_is_appended(served, target):
    """`conversation` (before: a 400, not supported): the response reads the conversation's items before
    its input, as the chat completion of the whole conversation does, and its input and output are
    appended, whole and streamed; with `previous_response_id` it is OpenAI's 400, an unknown one a 404."""
    client = _openai(target)
    conversation = client.conversations.create(items=[{"role": "user", "content": "One."},
                                                      {"role": "assistant", "content": "Yes."}])
    first = client.responses.create(model="tiny", input="Two.", conversation=conversation.id, max_output_tokens=6,
                                    **GREEDY)
    messages = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Yes."},
                {"role": "user", "content": "Two."}]
    text, usage = _chat_text(served, messages, max_tokens=6, **GREEDY)
    assert first.output_text == text and first.usage.input_tokens == usage.prompt_tokens
    assert first.conversation.id == conversation.id
    with client.responses.stream(model="tiny", input=[{"role": "user", "content": "Three."}], max_output_tokens=6,
                                 conversation={"id": conversation.id}, **GREEDY) as stream:
        second = list(stream)[-1].response  # (response.completed, or .incomplete: max_output_tokens)
    text, _ = _chat_text(served, messages + [{"role": "assistant", "content": first.output_text},
                                             {"role": "user", "content": "Three."}], max_tokens=6, **GREEDY)
    assert second.output_text == text
    items = client.conversations.items.list(conversation.id, order="asc", limit=100).data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "One."), ("assistant", "Yes."), ("user", "Two."), ("assistant", first.output_text),
        ("user", "Three."), ("assistant", second.output_text)]
    assert items[3].id == first.output[0].id  # (the output is kept as the response showed it)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", conversation=conversation.id, previous_response_id=first.id)
    assert caught.value.param == "conversation" and "previous_response_id" in caught.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", input="x", conversation="conv_nope", max_output_tokens=2)
    assert missing.value.body["param"] == "conversation"
    counted = client.responses.input_tokens.count(model="tiny", input="Four.", conversation=conversation.id)
    assert counted.input_tokens > first.usage.input_tokens
    if target.other_key is not None:
        with pytest.raises(openai.NotFoundError):
            _openai(target, target.other_key).responses.create(model="tiny", input="x", conversation=conversation.id,
                                                               max_output_tokens=2)
    client.conversations.delete(conversation.id)


def test_openai_agents_conversations_session_keeps_the_conversation(target):
    """openai-agents' OpenAIConversationsSession (the runner reads the conversation's items, sends them
    before the turn's input, and adds the turn's items), and a run on `conversation_id` (the Responses
    API's `conversation`). Each turn is one forced call of a tool whose result is the final output."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool,
                        set_tracing_disabled)
    from agents.memory import OpenAIConversationsSession
    set_tracing_disabled(True)

    @function_tool
    def weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=target.key, max_retries=0, timeout=120)
    agent = Agent(name="weather", instructions="Use the tool.", tools=[weather], tool_use_behavior="stop_on_first_tool",
                  model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="weather", temperature=1.0, max_tokens=60,
                                               extra_body={"seed": 7}))
    config = RunConfig(tracing_disabled=True)

    async def run():
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(agent, "Weather?", session=session, run_config=config)
        second = await Runner.run(agent, "And now?", session=session, run_config=config)
        sent = [item async for item in client.responses.input_items.list(second.raw_responses[0].response_id,
                                                                          order="asc")]
        items = await session.get_items()
        popped = await session.pop_item()
        left = await session.get_items()
        await session.clear_session()
        conversation = await client.conversations.create()
        await Runner.run(agent, "Weather?", conversation_id=conversation.id, run_config=config)
        kept = [item async for item in client.conversations.items.list(conversation.id, order="asc")]
        return first, sent, items, popped, left, kept

    first, sent, items, popped, left, kept = asyncio.run(run())
    assert first.final_output.startswith("sunny in")
    kinds = ["message", "function_call", "function_call_output"]
    assert [item["type"] for item in items] == kinds * 2, items
    assert [item.type for item in sent] == kinds + ["message"]  # (the first turn, read from the conversation)
    assert sent[1].call_id == items[1]["call_id"] and sent[3].content[0].text == "And now?"
    assert popped["id"] == items[-1]["id"] and len(left) == 5
    assert [item.type for item in kept] == ["message", "function_call"]


def test_a_failed_stream_is_stored_as_the_failed_response():
    """A stream that ends `response.failed` is stored so, as OpenAI's (before: not stored at all, so a
    retrieve of its id was a 404); it is not appended to its conversation."""
    from treeserve.wire.conversations_api import ConversationsAPI, MemoryConversationStore
    from treeserve.wire.errors import APIError
    from treeserve.wire.responses import ResponsesRequest
    from treeserve.wire.responses_api import MemoryResponseStore, ResponsesAPI

    async def cut_chat(body: dict):  # (a relayed chat's stream cut part way: the gateway's backend_stream_cut)
        async def chunks():
            yield {"choices": [{"index": 0, "delta": {"content": "par"}}]}
            raise APIError(502, "the backend's stream was cut", code="backend_stream_cut")
        return chunks()

    async def run():
        conversations = ConversationsAPI(MemoryConversationStore())
        api = ResponsesAPI(MemoryResponseStore(), conversations)
        conversation = await conversations.create([], None)
        events = await api.create(ResponsesRequest(input="x", stream=True, conversation=conversation["id"]), cut_chat,
                                  "tiny")
        sent = [json.loads(line.split("data: ", 1)[1]) async for line in events]
        return sent, await api.retrieve(sent[-1]["response"]["id"]), await conversations.list_items(conversation["id"])

    sent, stored, items = asyncio.run(run())
    assert sent[-1]["type"] == "response.failed"
    assert stored["status"] == "failed" and stored["error"]["code"] == "server_error" and stored == sent[-1]["response"]
    assert stored["output"][0]["content"][0]["text"] == "par" and items["data"] == []


def test_tools_and_text_format_are_checked_and_list_items_named_as_openai_names_them(target):
    """A tool of a type no API defines is OpenAI's invalid value, one of OpenAI's built-in types an
    unsupported parameter, both naming `tools[0].type`; a list item pydantic refuses is named
    `tools[0]` (it was pydantic's `tools.0`); json_schema without its `name` is OpenAI's missing
    parameter (it was taken, named "response")."""
    client = _openai(target)
    for body, param, code in [({"tools": [{"type": "nonsense"}]}, "tools[0].type", "invalid_value"),
                              ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
                              ({"tools": ["add"]}, "tools[0]", "invalid_type"),
                              ({"input": ["x"]}, "input", None),
                              ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
                               "text.format.name", "missing_required_parameter")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", **({"input": "x", "max_output_tokens": 2} | body))
        assert caught.value.param == param and (code is None or caught.value.code == code), caught.value.body
        assert caught.value.body["message"].startswith(param), caught.value.body


def test_a_conversation_holds_at_most_its_bound_of_items(target):
    """A conversation holds at most MAX_ITEMS_PER_CONVERSATION items (before: none, so a client could grow
    one without end, 20 items at a time, in the server's memory or the gateway's database): an add past
    it is a 400 naming `items` and saying what fits, a response continuing a full conversation a 400
    naming `conversation` (before it runs); deleting items makes room again."""
    from treeserve.wire.conversations import MAX_ITEMS_PER_CONVERSATION, MAX_ITEMS_PER_REQUEST
    client = _openai(target)
    batch = [{"role": "user", "content": "x"}] * MAX_ITEMS_PER_REQUEST
    conversation = client.conversations.create(items=batch)
    for _ in range(MAX_ITEMS_PER_CONVERSATION // MAX_ITEMS_PER_REQUEST - 1):
        client.conversations.items.create(conversation.id, items=batch)
    with pytest.raises(openai.BadRequestError) as full:
        client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "one more"}])
    assert full.value.param == "items" and full.value.code == "conversation_full", full.value.body
    assert f"at most {MAX_ITEMS_PER_CONVERSATION}" in full.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="x", conversation=conversation.id, max_output_tokens=2)
    assert refused.value.param == "conversation" and refused.value.code == "conversation_full", refused.value.body
    newest = client.conversations.items.list(conversation.id, limit=2).data
    client.conversations.items.delete(newest[0].id, conversation_id=conversation.id)
    with pytest.raises(openai.BadRequestError) as counted:  # (a string input is an item too, as in a response)
        client.responses.input_tokens.count(model="tiny", input="x", conversation=conversation.id)
    assert counted.value.param == "conversation" and counted.value.code == "conversation_full", counted.value.body
    client.conversations.items.delete(newest[1].id, conversation_id=conversation.id)
    added = client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "fits"}] * 2)
    assert client.conversations.items.list(conversation.id, limit=1).data[0].id == added.data[-1].id
    client.conversations.delete(conversation.id)


def test_a_responses_metadata_is_within_openais_bounds(target):
    """A response's metadata: at most 16 pairs, keys of 64 characters, values of 512, as OpenAI's
    (before: any size was taken, kept with the stored response and echoed)."""
    client = _openai(target)
    for metadata, param in [({f"k{i}": "v" for i in range(17)}, "metadata"), ({"k": "v" * 513}, "metadata.k")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, metadata=metadata)
        assert caught.value.param == param, caught.value.body
    kept = {f"k{i}": "v" * 512 for i in range(16)}
    assert client.responses.create(model="tiny", input="x", max_output_tokens=2, metadata=kept).metadata == kept


def test_the_gateway_serves_conversations_without_v1(gateway):
    """`/conversations` without `/v1`, as `/responses` is (LiteLLM's unversioned routes): before, a 404."""
    client = openai.OpenAI(base_url=gateway.url, api_key=gateway.keys[0], max_retries=0, timeout=60)
    conversation = client.conversations.create(items=[{"role": "user", "content": "a"}])
    assert [item.content[0].text for item in client.conversations.items.list(conversation.id)] == ["a"]
    assert httpx.get(f"{gateway.url}/conversations/{conversation.id}").status_code == 401  # (its key check)
    assert client.conversations.delete(conversation.id).deleted
