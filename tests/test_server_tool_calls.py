"""Tool calling through the official `openai` client, on three servers of one tiny model: with the
Hermes parser and template, with the Llama 3.1 JSON parser and template, and with no parser.
`required` and named choices return calls whose arguments validate (jsonschema), whole and
streamed; `auto` reads calls that the model writes in the parser's format (here the model is made
to write them with a `structured_outputs` choice: a random model would not). The bundled tool router,
served as the README shows, calls exactly with its own template; replacing that template is warned about."""
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from conftest import API_KEY, assert_no_leak, running_server, wait_idle
from treeserve.entrypoints.chat_utils import load_chat_template, warn_replaced_tool_templates
from treeserve.server.launch import build_app
from treeserve.server.tool_calls import ToolSettings
from treeserve.testing.tiny_models import make_tiny_model

EXAMPLES = Path(__file__).parent.parent / "examples"
S = {"type": "string", "maxLength": 8}
PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "add": {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"},
                                                        "minItems": 1, "maxItems": 4}},
            "required": ["values"], "additionalProperties": False},
    "book": {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                              "seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                              "note": {"anyOf": [S, {"type": "null"}]}},
             "required": ["day", "seats", "note"], "additionalProperties": False},
    "locate": {"type": "object", "properties": {"where": {"$ref": "#/$defs/place"}}, "required": ["where"],
               "additionalProperties": False,
               "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                                   "required": ["lat", "lon"], "additionalProperties": False}}},
    "flag": {"type": "object", "properties": {"on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
             "required": ["on", "level"], "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in PARAMETERS.items()] + [{"type": "function", "function": {"name": "now"}}]
PARAMETERS["now"] = {"type": "object", "properties": {}, "additionalProperties": False}
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is the weather?"}]
SERVERS = {"hermes": "tool_chat_template_hermes.jinja", "llama3_json": "tool_chat_template_llama3_json.jinja", None: None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # EOS and "]" favoured: where the grammar allows the end (or the end of a JSON array of calls),
    # the model ends (as a trained one would), rather than writing calls until max_tokens
    return make_tiny_model("llama", tmp_path_factory.mktemp("tools") / "llama", seed=3, max_position_embeddings=2048,
                           favour_tokens={"<|eos|>": 6.0, "]": 4.0})


@pytest.fixture(scope="module", params=list(SERVERS), ids=lambda p: p or "no-parser")
def served(request, model_dir):
    parser = request.param
    template = load_chat_template(str(EXAMPLES / SERVERS[parser])) if parser else None
    app = build_app(str(model_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=64 << 20, max_model_len=2048, chat_template=template,
                    tool_settings=ToolSettings(parser, auto=parser is not None))
    with running_server(app) as url:
        yield SimpleNamespace(parser=parser, url=url, engine=app.state.engine.engine, async_engine=app.state.engine,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0))


def _check_calls(calls, allowed: set[str]):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _collect(chunks):
    """A streamed choice's content, calls (from OpenAI's deltas) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:  # announced: index, id, type and name first, arguments after
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    calls[d.index] = SimpleNamespace(id=d.id, type=d.type, function=SimpleNamespace(
                        name=d.function.name, arguments=d.function.arguments or ""))
                else:
                    assert d.function.name is None
                    calls[d.index].function.arguments += d.function.arguments
            finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


def test_required_and_named_calls_validate_whole_and_streamed(served):
    client = served.client
    choices = ["required"] + [{"type": "function", "function": {"name": name}} for name in PARAMETERS]
    for seed, choice in enumerate(choices):
        allowed = set(PARAMETERS) if choice == "required" else {choice["function"]["name"]}
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                             max_tokens=300, seed=seed, n=2, temperature=1.0)
        ends = "tool_calls" if choice == "required" else "stop"  # (a named call ends "stop": OpenAI's, vLLM's)
        for c in out.choices:
            assert c.finish_reason == ends, c.message
            _check_calls(c.message.tool_calls, allowed)
            if choice != "required":
                assert len(c.message.tool_calls) == 1
        chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                max_tokens=300, seed=seed, temperature=1.0, stream=True)
        content, calls, finish = _collect(chunks)
        assert finish == ends and not content.strip()
        _check_calls(calls, allowed)
    wait_idle(served.engine)
    assert_no_leak(served.engine)


def test_parallel_tool_calls_false_gives_one_call(served):
    for seed in range(3):
        out = served.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                    tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                                                    seed=seed, temperature=1.0)
        assert len(out.choices[0].message.tool_calls) == 1


WRITTEN = {  # what a model trained on each format writes
    "hermes": ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"values": [2, 3]}}\n</tool_call>', "Checking.\n"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; '
                    '{"name": "add", "parameters": {"values": [2, 3]}}', None),
}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_calls_written_in_the_parsers_format(served, stream):
    text, content = WRITTEN[served.parser or "hermes"]
    body = {"structured_outputs": {"choice": [text]}}
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=body)
    if served.parser is None:  # no parser: tool_choice defaults to "none", and calls written as text stay text
        if stream:
            got, calls, finish = _collect(served.client.chat.completions.create(stream=True, **kwargs))
        else:
            choice = served.client.chat.completions.create(**kwargs).choices[0]
            got, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        assert (got, calls or None, finish) == (text, None, "stop")
        return
    if stream:
        got_content, calls, finish = _collect(served.client.chat.completions.create(stream=True, **kwargs))
        got_content = got_content or None
    else:
        choice = served.client.chat.completions.create(**kwargs).choices[0]  # tool_choice left out: auto
        got_content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls" and got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"values": [2, 3]})]
    plain = served.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=20,
                                                  tool_choice="auto",
                                                  extra_body={"structured_outputs": {"choice": ["It is sunny {ok}."]}})
    assert plain.choices[0].message.content == "It is sunny {ok}." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_a_conversation_with_calls_and_results_renders_the_tools(served):
    client = served.client
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
        {"role": "user", "content": "Thanks."}]
    out = client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, tool_choice="none",
                                         max_tokens=5)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    if served.parser is None:
        return  # the tiny model's own template shows no tools
    auth = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{served.url}/tokenize", headers=auth,
                        json={"model": "tiny", "messages": conversation, "tools": TOOLS}).json()["tokens"]
    rendered = httpx.post(f"{served.url}/detokenize", headers=auth, json={"model": "tiny", "tokens": tokens}).json()["prompt"]
    assert "the book tool" in rendered and "4 degrees" in rendered and '"city": "Oslo"' in rendered


def test_bad_tool_requests_are_400s_naming_the_field(served):
    client = served.client
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
        (dict(tools=TOOLS + TOOLS[:1]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "nope"}}}}}], tool_choice="required"), "tools[0].function.parameters"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
         "tools[0].function.parameters"),  # (arguments are an object: a forced call of this could never be one)
        (dict(messages=MESSAGES + [{"role": "tool", "content": "4"}]), "messages[2].tool_call_id"),
        (dict(messages=MESSAGES + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
         "messages[2].tool_calls[0].function.arguments"),
    ]
    if served.parser is None:
        cases.append((dict(tools=TOOLS, tool_choice="auto"), "tool_choice"))
    for extra, param in cases:
        kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5} | extra
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**kwargs)
        assert bad.value.body["param"] == param, (param, bad.value.body)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"tools": TOOLS})
    assert bad.value.body["param"] == "tools"
    assert served.async_engine.errored is None
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")
    wait_idle(served.engine)
    assert_no_leak(served.engine)


def test_an_answer_ending_in_eos_keeps_its_text_clean(served):
    """The Hermes parser keeps special tokens in the text (its markers may be special); the EOS that
    ends the answer is not part of it (as vLLM: a stop token's text only with include_stop_str_in_output)."""
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=60, seed=1, temperature=1.0)
        if stream:
            content, calls, finish = _collect(served.client.chat.completions.create(stream=True, **kwargs))
        else:
            choice = served.client.chat.completions.create(**kwargs).choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
        assert finish == "stop" and "<|eos|>" not in content, (served.parser, content)


ROUTER_QUESTIONS = {"What is 17 * 23 + 5?": ("sympy", {"operation": "evaluate", "expression": "17 * 23 + 5"}),
                    "Solve 3*x + 4 = 19": ("sympy", {"operation": "solve", "expression": "3*x + 4 = 19"}),
                    "Hello!": ("answer_directly", {})}


def test_the_bundled_router_calls_exactly_with_its_own_template():
    """README's tool-calling example: `treeserve serve builtin:arith-router --enable-auto-tool-choice
    --tool-call-parser hermes` (no --chat-template), served as `arith-router`; `tool_choice` auto."""
    from treeserve.gateway.chat.tools import ANSWER, ROUTER_PROMPT, SYMPY

    app = build_app("builtin:arith-router", dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
                    tool_settings=ToolSettings("hermes", auto=True))
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["arith-router"]
        for question, (name, arguments) in ROUTER_QUESTIONS.items():
            messages = [{"role": "system", "content": ROUTER_PROMPT}, {"role": "user", "content": question}]
            choice = client.chat.completions.create(model="arith-router", messages=messages, tools=[SYMPY, ANSWER],
                                                    temperature=0.0, max_tokens=64).choices[0]
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
            assert (choice.finish_reason, calls) == ("tool_calls", [(name, arguments)]), question
        with pytest.raises(openai.NotFoundError, match="did you mean 'arith-router'"):
            client.chat.completions.create(model="builtin:arith-router", messages=MESSAGES, max_tokens=1)


def test_a_chat_template_replacing_one_that_renders_tools_is_warned_about(caplog):
    from treeserve.cli import build_parser
    from treeserve.server.launch import app_from_args

    template = str(EXAMPLES / SERVERS["hermes"])
    args = build_parser().parse_args(["serve", "builtin:arith-router", "--chat-template", template,
                                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--dtype",
                                      "float32", "--device", "cpu", "--kv-cache-memory-bytes", str(16 << 20)])
    with caplog.at_level("WARNING", logger="treeserve.entrypoints.chat_utils"):
        app = app_from_args(args)
    app.state.engine.shutdown()
    assert app.state.served_models == ["arith-router"]
    [warning] = [r.getMessage() for r in caplog.records if r.name == "treeserve.entrypoints.chat_utils"]
    assert "model 'arith-router'" in warning and template in warning and "renders tools" in warning


def test_only_templates_that_render_tools_are_warned_about(caplog):
    own = SimpleNamespace(chat_template="{% if tools %}{{ tools | tojson }}{% endif %}")
    plain = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    given = load_chat_template(str(EXAMPLES / SERVERS["hermes"]))
    with caplog.at_level("WARNING", logger="treeserve.entrypoints.chat_utils"):
        assert warn_replaced_tool_templates({"router": own, "gen": plain}, given, "t.jinja") == ["router"]
        assert warn_replaced_tool_templates({"router": own}, None, None) == []  # no --chat-template
        assert warn_replaced_tool_templates({"router": own}, own.chat_template, "own.jinja") == []  # its own
    [warning] = [r.getMessage() for r in caplog.records if r.name == "treeserve.entrypoints.chat_utils"]
    assert "model 'router'" in warning and "the --chat-template text" in warning


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_kept_whole_and_streamed(served, stream):
    """A reply cut by max_tokens inside a call (once its name was read) has that call, its arguments as
    far as they went, finish `length`, whole as streamed (OpenAI's keeps it so; Anthropic's reply has the
    incomplete tool_use block). Before: the stream sent the call, and the whole reply dropped it and
    gave the call's text as the content. Every fourth token cut through the model and the server (every
    character cut of such texts: tests/test_tool_parsers.py; each cut here is a request, whole and
    streamed, and every cut took 70 s of the suite)."""
    if served.parser is None:
        return  # (no parser: calls written as text stay text)
    text, _ = WRITTEN[served.parser]
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, extra_body={"structured_outputs": {"choice": [text]}})
    full = served.client.chat.completions.create(max_tokens=200, **kwargs)
    cut_short = 0
    for max_tokens in range(1, full.usage.completion_tokens, 4):
        whole = served.client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert whole.finish_reason == "length"
        if stream:
            content, streamed, finish = _collect(served.client.chat.completions.create(
                max_tokens=max_tokens, stream=True, **kwargs))
            assert finish == "length" and [(c.function.name, c.function.arguments) for c in streamed] == calls
            assert (content or None) == whole.message.content, (max_tokens, content, whole.message.content)
        if calls and not calls[-1][1].endswith("}"):
            cut_short += 1
            assert text.startswith(whole.message.content or "") and '"name"' not in (whole.message.content or "")
    assert cut_short > 2  # (cuts inside a call's arguments were met)


def test_allowed_tools_restrict_the_usable_tools(served):
    """OpenAI's `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`: calls of
    the named tools only (mode required: at least one; auto: as the model decides), the prompt showing
    only those; a name that is not a tool is a 400 naming it. Before: a 400 for the form itself."""
    client, allowed = served.client, [{"type": "function", "function": {"name": name}} for name in ("add", "now")]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": allowed}}
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                             max_tokens=300, seed=seed, temperature=1.0)
        _check_calls(out.choices[0].message.tool_calls, {"add", "now"})
    content, calls, _ = _collect(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                                tool_choice=choice, max_tokens=300, stream=True))
    _check_calls(calls, {"add", "now"})
    subset = [tool for tool in TOOLS if tool["function"]["name"] in ("add", "now")]
    shown = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=subset, tool_choice="none",
                                           max_tokens=1).usage.prompt_tokens
    if served.parser is not None:
        auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": allowed}}
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=auto,
                                             max_tokens=1)
        assert out.usage.prompt_tokens == shown < client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    wrong = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": allowed + [
        {"type": "function", "function": {"name": "fly"}}]}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=wrong, max_tokens=5)
    assert caught.value.body["param"] == "tool_choice.allowed_tools.tools[2].function.name", caught.value.body
    wait_idle(served.engine)
    assert_no_leak(served.engine)


def test_a_function_message_is_rendered_as_vllm_does(served):
    """OpenAI's deprecated `role: "function"` (a function's result, with its `name`): passed to the chat
    template as it is, as vLLM does (it was a 400); without its name, a 400 naming it (as OpenAI's types)."""
    conversation = MESSAGES + [{"role": "function", "name": "get_weather", "content": "4 degrees"}]
    out = served.client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, max_tokens=2,
                                                tool_choice="none")
    assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(model="tiny", messages=MESSAGES + [{"role": "function", "content": "4"}],
                                              max_tokens=2)
    assert caught.value.body["param"] == "messages[2].name", caught.value.body
    if served.parser == "hermes":  # (its template writes any other role's turn as it is)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        tokens = httpx.post(f"{served.url}/tokenize", headers=auth,
                            json={"model": "tiny", "messages": conversation}).json()["tokens"]
        rendered = httpx.post(f"{served.url}/detokenize", headers=auth,
                              json={"model": "tiny", "tokens": tokens}).json()["prompt"]
        assert "<|im_start|>function\n4 degrees" in rendered, rendered
