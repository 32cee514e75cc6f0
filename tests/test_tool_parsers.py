"""Tool-call formats: calls read from whole texts and from streams cut anywhere (the deltas add up
to the whole reading), and the forcing grammars (sampled token by token from what llguidance
allows) produce calls that the same format reads back and that validate against the parameters."""
import json
import random

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from treeserve.wire.chat_completions import ChatCompletionRequest
from treeserve.server.tool_calls import ToolCalling, ToolCallStream, ToolSettings
from treeserve.server.tool_parsers import FORCED_FORMAT, TOOL_CALL_FORMATS, scan_object

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SUM = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
       "required": ["values"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"where": {"$ref": "#/$defs/place"}}, "required": ["where"],
          "additionalProperties": False,
          "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "integer"}, "lon": {"type": "integer"}},
                              "required": ["lat", "lon"], "additionalProperties": False}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "sum", "parameters": SUM}},
         {"type": "function", "function": {"name": "locate", "parameters": NESTED}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}

HERMES_TEXT = ('Let me look {"that"} up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}is\\"",'
               ' "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"values": [1, 2]}, "name": "add"}\n'
               '</tool_call>\n<tool_call>\n{"name": "now"}\n</tool_call>')
LLAMA_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; '
              '{"name": "add", "parameters": {"values": [3]}}')
ARRAY_TEXT = '[{"name":"locate","parameters":{"where":{"lat":1,"lon":-2}}},{"name":"now","parameters":{}}]'
EXPECTED = {
    "hermes": ("Let me look {\"that\"} up.\n", [("get_weather", '{"city": "Par}is\\"", "unit": "celsius"}'),
                                              ("add", '{"values": [1, 2]}'), ("now", "{}")]),
    "llama3_json": (None, [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("add", '{"values": [3]}')]),
    "json": (None, [("locate", '{"where":{"lat":1,"lon":-2}}'), ("now", "{}")]),
}
TEXTS = {"hermes": HERMES_TEXT, "llama3_json": LLAMA_TEXT, "json": ARRAY_TEXT}


def calling(format_name: str, choice="auto", parallel=True, tools=TOOLS) -> ToolCalling:
    parser = None if format_name == "json" else format_name
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": parallel})
    return ToolCalling.from_request(request, ToolSettings(parser, auto=parser is not None))


def whole(format_name: str, text: str, parallel=True):
    message, reason = calling(format_name, "required" if format_name == "json" else "auto",
                              parallel).message(text, "stop")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message["content"], calls, reason


def streamed(format_name: str, text: str, pieces: list[str], parallel=True):
    stream = ToolCallStream(calling(format_name, "required" if format_name == "json" else "auto", parallel))
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta
        for d in deltas:
            if "id" in d:  # announced: index, id, type, name (and the arguments so far)
                assert d["index"] == len(calls) and d["type"] == "function" and "name" in d["function"]
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                assert set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
        assert len({d["index"] for d in deltas}) == len(deltas)  # one entry per call in a chunk
    return content or None, [tuple(c) for c in calls.values()], stream.finish_reason("stop")


def cuts(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "json"])
def test_whole_text_reads_every_call(format_name):
    content, calls, reason = whole(format_name, TEXTS[format_name])
    assert (content, calls) == EXPECTED[format_name] and reason == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "json"])
def test_stream_cut_anywhere_adds_up_to_the_whole_reading(format_name):
    text = TEXTS[format_name]
    expected = whole(format_name, text)
    assert streamed(format_name, text, list(text) + [""]) == expected  # one character at a time
    for seed in range(60):
        assert streamed(format_name, text, cuts(text, seed)) == expected, seed


def test_answers_without_calls_are_content_whole_and_streamed():
    for format_name, text in [("hermes", "It is 18C in <b>Paris</b> < tool_call"), ("llama3_json", "  Sunny, {maybe}."),
                              ("hermes", "<tool_call>\n{not json}\n</tool_call>")]:
        assert whole(format_name, text) == (text, [], "stop")
        for seed in range(20):
            assert streamed(format_name, text, cuts(text, seed) + [""]) == (text, [], "stop"), (text, seed)
    # arguments that are not an object: no call, whole (a stream has announced the call by then)
    text = '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'
    assert whole("hermes", text) == (text, [], "stop")


def test_a_call_cut_short():
    """A call cut by max_tokens once its name was read is a call, whole or streamed: its arguments as
    far as they went, the finish reason `length` (OpenAI's reply keeps the call with its arguments cut
    short; Anthropic's an incomplete tool_use block). The whole reply dropped it (the text was the
    answer) while the stream had announced it and sent its arguments."""
    text = '{"name": "add", "parameters": {"values": [1'
    message, reason = calling("llama3_json").message(text, "length")
    assert reason == "length" and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "add", "arguments": '{"values": [1'}]
    stream = ToolCallStream(calling("llama3_json"))
    content, deltas = stream.feed(text, final=False)
    assert content == "" and [d["function"] for d in deltas] == [{"name": "add", "arguments": '{"values": [1'}]
    assert stream.feed("", final=True, cut=True) == ("", [])
    assert stream.finish_reason("length") == "length"
    # the whole text in the last delta: still the call, as the whole reply
    last = ToolCallStream(calling("llama3_json"))
    content, deltas = last.feed(text, final=True, cut=True)
    assert content == "" and [d["function"] for d in deltas] == [{"name": "add", "arguments": '{"values": [1'}]
    # a valid call then one cut: both; cut before its name was read: no call but the first
    hermes = '<tool_call>\n{"name": "now"}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"va'
    names = [c["function"]["name"] for c in calling("hermes").message(hermes, "length")[0]["tool_calls"]]
    assert names == ["now", "add"]
    nameless = '<tool_call>\n{"name": "now"}\n</tool_call>\n<tool_call>\n{"name": "ad'
    assert [c["function"]["name"] for c in calling("hermes").message(nameless, "length")[0]["tool_calls"]] == ["now"]
    # stopped (not cut) with an unfinished call: no call, the text is the answer (as before)
    assert calling("llama3_json").message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


def _reply_cut_at(format_name: str, text: str, seed: int):
    """`text` streamed in random pieces as max_tokens cut it (the server's last feed says `cut`): content,
    calls, finish reason; and the whole reply's, as `message` reads the same text."""
    stream = ToolCallStream(calling(format_name))
    content, calls = "", {}
    pieces = cuts(text, seed) if len(text) > 1 else [text]
    for i, piece in enumerate(pieces):
        delta, deltas = stream.feed(piece, final=i == len(pieces) - 1, cut=i == len(pieces) - 1)
        content += delta
        for d in deltas:
            calls.setdefault(d["index"], [d["function"].get("name"), ""])[1] += d["function"]["arguments"]
    message, reason = calling(format_name).message(text, "length")
    whole_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return ((content or None, [tuple(c) for c in calls.values()], stream.finish_reason("length")),
            (message["content"], whole_calls, reason))


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json"])
def test_a_reply_cut_at_any_character_streams_as_the_whole_reply_reads(format_name):
    """Every cut of a text with calls (as max_tokens would cut it, token or character): the streamed
    deltas add up to the whole reply's content and calls, its arguments as far as they went (the
    server-level test in test_server_tool_calls.py checks every fourth token cut through the model)."""
    text, cut_in_arguments = TEXTS[format_name], 0
    for end in range(1, len(text) + 1):
        streamed_reply, whole_reply = _reply_cut_at(format_name, text[:end], seed=end)
        assert streamed_reply == whole_reply, (end, text[:end])
        cut_in_arguments += any(not arguments.endswith("}") for _, arguments in whole_reply[1])
    assert cut_in_arguments > 10


def test_parallel_false_keeps_the_first_call():
    content, calls, _ = whole("hermes", HERMES_TEXT, parallel=False)
    assert calls == EXPECTED["hermes"][1][:1]
    assert streamed("hermes", HERMES_TEXT, cuts(HERMES_TEXT, 3), parallel=False)[1] == calls


def test_scan_object_partial_and_complete():
    call, end = scan_object('{"name": "f", "arguments": {"a": "x}y", "b": [1, {"c": 2}]}} tail', 0)
    assert (call.name, call.arguments, call.complete, end) == ("f", '{"a": "x}y", "b": [1, {"c": 2}]}', True, 60)
    call, end = scan_object('{"name": "f", "arguments": {"a": "x}y", "b": [1', 0)
    assert (call.name, call.arguments, call.complete, end) == ("f", '{"a": "x}y", "b": [1', False, None)
    call, _ = scan_object('{"name": "f', 0)
    assert call.name is None and call.arguments == ""


def _sample_forced(matcher, tokenizer, rng, limit=600) -> str:
    """Random tokens among those the grammar allows (stopping as soon as it may): a model with no
    preference at all, the worst case for a grammar."""
    vocab, out = len(tokenizer), []
    for _ in range(limit):
        mask = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        allowed = [t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]
        if tokenizer.eos_token_id in allowed and rng.random() < 0.7:
            break
        token = rng.choice([t for t in allowed if t != tokenizer.eos_token_id] or allowed)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
        if matcher.is_stopped():
            break
    else:
        raise AssertionError("the grammar never allowed the end")
    return tokenizer.decode(out)


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "locate"}}])
def test_forced_grammar_writes_calls_that_validate(format_name, choice):
    from treeserve.model.random_models import train_tokenizer

    tokenizer = train_tokenizer(512)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])
    tools = calling(format_name, choice)
    assert tools.forced and tools.format is (FORCED_FORMAT if format_name == "json" else TOOL_CALL_FORMATS[format_name])
    grammar = llguidance.grammar_from("lark", tools.structured_outputs().grammar)
    assert not llguidance.LLMatcher.validate_grammar(grammar, lltok)
    rng, names = random.Random(0), set()
    for _ in range(12):
        text = _sample_forced(llguidance.LLMatcher(lltok, grammar), tokenizer, rng)
        content, calls, reason = whole(format_name, text)
        assert calls and reason == "tool_calls", text
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            names.add(name)
    if isinstance(choice, dict):
        assert names == {"locate"}, names  # the named function, and no other
    else:
        assert len(names) >= 2, names  # "required" lets the model call any of the tools


def test_markers_that_are_special_tokens_are_forced_as_those_tokens():
    """A vocabulary where `<tool_call>` is one special token: the grammar writes that token (as the
    model was trained to), and the text decoded with special tokens kept reads back as calls."""
    from treeserve.model.random_models import train_tokenizer
    from treeserve.server.tool_calls import special_tokens

    tokenizer = train_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    specials = special_tokens(tokenizer)
    assert {"<tool_call>", "</tool_call>", "<|eos|>"} <= specials
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": TOOLS[:1], "tool_choice": "required"})
    tools = ToolCalling.from_request(request, ToolSettings("hermes", auto=True), specials)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", tools.structured_outputs().grammar))
    assert not matcher.is_error(), matcher.get_error()
    mask = torch.full(((len(tokenizer) + 31) // 32,), -1, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
    first = [t for t in range(len(tokenizer)) if (int(mask[t // 32]) >> (t % 32)) & 1]
    assert first == [open_id]  # the one token, not "<" "tool" "_call" ">"
    text = _sample_forced(matcher, tokenizer, random.Random(1))
    assert text.startswith("<tool_call>") and close_id in tokenizer.encode(text, add_special_tokens=False)
    assert whole("hermes", text)[1][0][0] == "get_weather"


def test_offline_chat_renders_tools(llama_dir):
    from pathlib import Path

    from treeserve import LLM, SamplingParams

    template = (Path(__file__).parent.parent / "examples" / "tool_chat_template_hermes.jinja").read_text()
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    conversation = [{"role": "user", "content": "Weather in Oslo?"}]
    text = llm.get_tokenizer().decode(llm.apply_chat_template(conversation, chat_template=template, tools=TOOLS))
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert "<tools>" not in llm.get_tokenizer().decode(llm.apply_chat_template(conversation, chat_template=template))
    out = llm.chat(conversation, SamplingParams(max_tokens=3), use_tqdm=False, chat_template=template, tools=TOOLS[:1])
    assert len(out[0].prompt_token_ids) > 100 and len(out[0].outputs[0].token_ids) <= 3


def test_server_settings_are_checked():
    from treeserve.errors import ParamError

    with pytest.raises(ParamError, match="needs --tool-call-parser"):
        ToolSettings(None, auto=True)
    with pytest.raises(ParamError, match="unknown parser"):
        ToolSettings("mistral")
    assert calling("hermes", choice="none").reads_calls is False
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": TOOLS})
    assert ToolCalling.from_request(request, ToolSettings("hermes")).choice == "none"  # auto not enabled
    assert ToolCalling.from_request(request, ToolSettings("hermes", auto=True)).choice == "auto"


@pytest.mark.parametrize("text, content, calls", [
    # a complete call with no name is none, and does not hold back the calls after it
    ('<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>',
     None, [("now", "{}")]),
    # the tag mentioned in passing stays in the answer
    ('Use <tool_call> tags: <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Use <tool_call> tags: ",
     [("now", "{}")]),
])
def test_hermes_edge_cases_whole_and_streamed(text, content, calls):
    assert whole("hermes", text) == (content, calls, "tool_calls")
    for seed in range(30):
        assert streamed("hermes", text, cuts(text, seed) + [""]) == (content, calls, "tool_calls"), seed


def test_nested_past_the_recursion_limit_is_no_call_and_no_crash():
    deep = "[" * 5000 + "]" * 5000
    text = '<tool_call>\n{"name": "add", "arguments": {"values": ' + deep + '}}\n</tool_call>'
    assert whole("hermes", text) == (text, [], "stop")
    from treeserve.errors import ParamError
    from treeserve.wire.chat_messages import template_messages

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "add", "arguments": deep}}]}]})
    with pytest.raises(ParamError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        template_messages(request.messages)


def test_a_call_that_is_not_json_as_a_whole_is_no_call():
    text = '<tool_call>\n{"name": "now", "arguments": {}, oops}\n</tool_call>'
    assert whole("hermes", text) == (text, [], "stop")


def test_named_choice_names_the_tools_index_of_a_bad_schema():
    tools = TOOLS + [{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": tools,
                                                    "tool_choice": {"type": "function", "function": {"name": "bad"}}})
    from treeserve.errors import ParamError

    def reject(spec):
        raise ParamError("structured_outputs.grammar", "cannot compile")
    located = ToolCalling.from_request(request, ToolSettings()).locate_schema_error(reject)
    assert located.param == f"tools[{len(TOOLS)}].function.parameters"


def test_a_long_call_streams_in_linear_time(monkeypatch):
    """Each call's scan goes on from where the last text ended: streamed in 6,700 small deltas, a
    20,000-character call is read one character at a time once, not once per delta."""
    from treeserve.server import tool_parsers

    reads = 0
    scan_char = tool_parsers._ObjectScan._char

    def counting(self, text, i):
        nonlocal reads
        reads += 1
        scan_char(self, text, i)
    monkeypatch.setattr(tool_parsers._ObjectScan, "_char", counting)
    body = '<tool_call>\n{"name": "now", "arguments": {"text": "' + "abc def " * 2500 + '"}}\n</tool_call>'
    pieces = [body[i:i + 3] for i in range(0, len(body), 3)]
    assert streamed("hermes", body, pieces)[1] == [("now", '{"text": "' + "abc def " * 2500 + '"}')]
    assert reads <= len(body)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "find"}}])
def test_forced_arguments_take_only_the_keys_the_parameters_list(choice):
    """Strict, as vLLM's (its tool schema compiled by xgrammar in strict mode): parameters without
    `additionalProperties` took any other key, and a model not trained on the tools wrote keys of its
    own until max_tokens; parameters that allow other keys still get them."""
    from treeserve.model.random_models import train_tokenizer

    tokenizer = train_tokenizer(512)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])
    place = {"type": "object", "properties": {"lat": {"type": "integer"}}}
    params = {"type": "object", "properties": {"city": {"type": "string"}, "near": {"$ref": "#/$defs/place"}},
              "$defs": {"place": place}}
    tools = [{"type": "function", "function": {"name": "find", "parameters": params}},
             {"type": "function", "function": {"name": "any", "parameters": {**params, "additionalProperties": True}}}]
    grammar = llguidance.grammar_from("lark", calling("json", choice, tools=tools).structured_outputs().grammar)

    def accepts(text: str) -> bool:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        return llguidance.LLMatcher(lltok, grammar).validate_tokens(tokens) == len(tokens)

    assert accepts('[{"name":"find","parameters":{"city":"x","near":{"lat":1}}}]')
    assert not accepts('[{"name":"find","parameters":{"city":"x","zz":1}}]')
    assert not accepts('[{"name":"find","parameters":{"near":{"lat":1,"zz":1}}}]')  # in its $defs too
    if choice == "required":
        assert accepts('[{"name":"any","parameters":{"city":"x","zz":1}}]')
        assert not accepts('[{"name":"any","parameters":{"near":{"lat":1,"zz":1}}}]')
