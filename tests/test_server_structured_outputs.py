"""Structured outputs through the official `openai` client: `response_format` (JSON schema, JSON
object) and vLLM's `structured_outputs` (choice, regex, grammar), validated with jsonschema."""
import json

import jsonschema
import openai
import pytest

from conftest import assert_no_leak, wait_idle

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                "required": ["x"]}}, "required": ["point"]},
    {"type": "object", "properties": {"v": {"type": ["integer", "null"]}}, "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1}},
     "required": ["kind", "r"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["n"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
     "required": ["items"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
     "required": ["answer"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
    {"type": "object", "properties": {"a": S, "b": S, "c": S}, "required": ["a", "b", "c"],
     "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [{"type": "integer"}, S],
                                               "items": False}}, "required": ["pair"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"k": S, "v": {"type": "integer"}},
                                               "required": ["k", "v"], "additionalProperties": False}},
     "required": ["meta"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}, "label": S},
     "required": ["score", "label"]},
]
MESSAGES = [{"role": "user", "content": "Give me the data as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


def _strict(schema):
    """As OpenAI's strict mode requires: no properties beyond those listed (a random model would
    otherwise write keys of its own, of unbounded length)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "data", "schema": _strict(schema), "strict": True}}


def test_twenty_schemas_validate_plain_streamed_and_n3(client, server):
    assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == 20
    for i, schema in enumerate(SCHEMAS):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=i, n=3,
                                             temperature=1.0, response_format=_format(schema))
        for choice in out.choices:
            assert choice.finish_reason == "stop", (i, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
        chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=i,
                                                temperature=1.0, response_format=_format(schema), stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), schema)
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def test_a_schema_without_additional_properties_gets_only_its_keys(client):
    """As a vLLM user gets by default (xgrammar's strict mode): the listed keys and no others, through
    response_format (strict or not) and structured_outputs.json alike; before, a random model wrote
    keys of its own until max_tokens. Keys the schema allows (`additionalProperties: true`) may come."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"]}
    closed = {**schema, "additionalProperties": False}
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": schema,
                                                                          "strict": False}}},
              {"structured_outputs": {"json": schema}}]
    for i, body in enumerate(bodies):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, seed=i, n=4,
                                             temperature=1.0, extra_body=body)
        for choice in out.choices:
            assert choice.finish_reason == "stop", (body, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), closed)
    seen = set()
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, seed=seed, n=4,
                                             temperature=1.0, response_format=_format_open(schema))
        # ("a" comes first, as required; then the next key's first letter)
        seen |= {c.message.content.split(",")[1][1:2] for c in out.choices if "," in c.message.content}
    assert seen - {"a", "b"}, seen  # other keys, where the schema allows them


def _format_open(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "d", "schema": {**schema, "additionalProperties": True}}}


def test_properties_come_in_the_schemas_order(client):
    """OpenAI writes a schema's properties in the order given; two schemas that differ only in
    that order are two grammars (the cache used to key them, and compile them, with sorted keys)."""
    for names in (["zeta", "alpha"], ["alpha", "zeta"]):
        schema = {"type": "object", "properties": {n: {"type": "integer", "minimum": 0, "maximum": 9} for n in names},
                  "required": names}
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, seed=0,
                                             response_format=_format(schema))
        assert list(json.loads(out.choices[0].message.content)) == names, out.choices[0].message.content


def test_a_grammar_the_engine_fails_on_part_way_is_an_error_not_a_stop(client, server):
    """2,001 choices pass compilation but pass llguidance's 2,000 items in a parser row at the first
    token: the reply was a 200 `finish_reason: stop` with text the grammar does not allow ("o")."""
    import httpx

    from treeserve.bench.sse_data import sse_data

    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10,
            "structured_outputs": {"choice": [f"opt{i}" for i in range(2001)]}}
    headers = {"Authorization": f"Bearer {server.key}"}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "grammar_failed", whole.text
    assert "max is 2000" in whole.json()["error"]["message"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True}, headers=headers,
                      timeout=60) as streamed:
        events = list(sse_data(streamed.iter_text()))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "grammar_failed", events[-3:]
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def test_json_object_on_completions(client):
    out = client.completions.create(model="tiny", prompt="JSON:", max_tokens=400, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict) and out.choices[0].finish_reason == "stop"


def test_structured_outputs_choice_regex_grammar_on_both_routes(client):
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, n=4, seed=2,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert {c.message.content for c in choice.choices} <= {"yes", "no", "maybe"}
    regex = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, seed=3,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    grammar = 'start: "(" num " " op " " num ")"\nnum: /[1-9]/\nop: "+" | "*"'
    lark = client.completions.create(model="tiny", prompt="Sum:", max_tokens=20, seed=4,
                                     extra_body={"structured_outputs": {"grammar": grammar}})
    text = lark.choices[0].text
    assert len(text) == 7 and text[0] == "(" and text[3] in "+*" and text[-1] == ")"


def test_stop_strings_and_seeds_with_a_grammar(client):
    body = {"structured_outputs": {"regex": "[a-c]{12}"}}
    first = client.completions.create(model="tiny", prompt="x", max_tokens=20, seed=7, extra_body=body)
    again = client.completions.create(model="tiny", prompt="x", max_tokens=20, seed=7, extra_body=body)
    assert first.choices[0].text == again.choices[0].text and len(first.choices[0].text) == 12
    cut = client.completions.create(model="tiny", prompt="x", max_tokens=20, seed=7, extra_body=body, stop=["c"])
    assert "c" not in cut.choices[0].text and first.choices[0].text.startswith(cut.choices[0].text)


def test_what_cannot_compile_is_a_400_naming_it(client, server):
    with pytest.raises(openai.BadRequestError, match="response_format") as bad:
        client.chat.completions.create(model="tiny", messages=MESSAGES,
                                       response_format=_format({"type": "object", "properties": {"a": {"type": "nope"}}}))
    assert bad.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="structured_outputs.regex"):
        client.completions.create(model="tiny", prompt="x", extra_body={"structured_outputs": {"regex": "[a-z"}})
    with pytest.raises(openai.BadRequestError, match="structural_tag"):
        client.completions.create(model="tiny", prompt="x", extra_body={"structured_outputs": {"structural_tag": "x"}})
    with pytest.raises(openai.BadRequestError, match="exactly one"):
        client.completions.create(model="tiny", prompt="x", extra_body={"structured_outputs": {"regex": "a",
                                                                                                "choice": ["b"]}})
    with pytest.raises(openai.BadRequestError, match="schema"):
        client.chat.completions.create(model="tiny", messages=MESSAGES,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert server.async_engine.errored is None
