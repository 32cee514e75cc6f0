"""Structured outputs offline: the grammar mask in the sampler, batched with free rows, n > 1,
compiled once per grammar; llguidance's packed bitmask unpacked exactly."""
import json

import jsonschema
import pytest
import torch

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams, StructuredOutputsParams
from treeserve.engine import structured_outputs
from treeserve.errors import ParamError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)


def test_constrained_and_free_rows_share_a_batch(llm):
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The water is"], free, use_tqdm=False)[0].outputs[0].text
    both = llm.generate(["The water is", "Data:"], [free, SamplingParams(
        temperature=1.0, seed=5, n=3, max_tokens=100, structured_outputs=StructuredOutputsParams(json=SCHEMA))],
        use_tqdm=False)
    assert both[0].outputs[0].text == alone  # the other rows' masks never touch a free row
    for completion in both[1].outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert_no_leak(llm.engine)


def test_choice_regex_and_grammar(llm):
    outs = llm.generate(["a", "b"], SamplingParams(n=4, seed=1, structured_outputs={"choice": ["red", "green"]}),
                        use_tqdm=False)
    assert {c.text for o in outs for c in o.outputs} <= {"red", "green"}
    regex = llm.generate(["a"], SamplingParams(seed=2, max_tokens=30, structured_outputs={"regex": r"\d{4}"}),
                         use_tqdm=False)[0].outputs[0]
    assert regex.text.isdigit() and len(regex.text) == 4 and regex.finish_reason == "stop"
    gbnf = 'root ::= "x=" [0-9] [0-9]'
    text = llm.generate(["a"], SamplingParams(seed=3, structured_outputs={"grammar": gbnf}),
                        use_tqdm=False)[0].outputs[0].text
    assert text.startswith("x=") and text[2:].isdigit() and len(text) == 4


def test_each_grammar_compiles_once_and_the_cache_is_bounded(llm, monkeypatch):
    cache = llm.engine.structured
    spec = StructuredOutputsParams(json=SCHEMA)
    # (the same schema as text; its keys in their order: a schema's property order is the output's)
    assert cache.compile(spec) is cache.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    monkeypatch.setattr(structured_outputs, "CACHE_SIZE", 2)
    for word in ("a", "b", "c"):
        cache.compile(StructuredOutputsParams(choice=[word]))
    assert len(cache._compiled) == 2


def test_a_dict_with_a_field_treeserve_lacks_is_named_offline():
    """(it was "structured_outputs: StructuredOutputsParams.__init__() got an unexpected keyword argument
    'structural_tag'": Python's words; the server's 400 names the field)"""
    with pytest.raises(ParamError) as refused:
        SamplingParams(structured_outputs={"structural_tag": "{}"})
    assert refused.value.param == "structured_outputs.structural_tag"
    assert str(refused.value) == ("structured_outputs.structural_tag: not implemented by treeserve; give exactly one "
                                  "of json, regex, choice, grammar, json_object")
    assert SamplingParams(structured_outputs={"regex": "[0-9]"}).structured_outputs == StructuredOutputsParams(
        regex="[0-9]")


def test_the_mask_allows_exactly_what_the_grammar_allows(llm):
    tokenizer = llm.get_tokenizer()
    cache = llm.engine.structured
    matcher = cache.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.zeros(2, llm.engine.model_config.vocab_size)
    structured_outputs.apply(logits, [None, matcher])
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert allowed and (logits[0] == 0).all()
    texts = [tokenizer.decode([t]) for t in allowed]
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert any(t in ("y", "ye", "yes") for t in texts) and any(t in ("n", "no") for t in texts)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3
    bitmask[0, 2] = -1  # bit 31 set: the sign bit
    assert structured_outputs.allowed_tokens(bitmask, 70)[0].nonzero().flatten().tolist() == [35] + list(range(64, 70))


def test_what_cannot_compile_names_the_field(llm):
    with pytest.raises(ParamError, match="structured_outputs.json") as bad:
        llm.generate(["a"], SamplingParams(structured_outputs={"json": {"type": "nope"}}), use_tqdm=False)
    assert bad.value.param == "structured_outputs.json"
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ParamError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert_no_leak(llm.engine)


OPEN = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {
    "type": "object", "properties": {"t": {"type": "string"}}}}}, "required": ["n"]}


def _accepts(llm, schema, text: str) -> bool:
    """Whether the grammar compiled for `schema` (or for a StructuredOutputsParams) takes all of `text`'s tokens."""
    spec = schema if isinstance(schema, StructuredOutputsParams) else StructuredOutputsParams(json=schema)
    tokens = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return llm.engine.structured.matcher(spec).validate_tokens(tokens) == len(tokens)


def test_an_object_takes_only_the_keys_it_lists_unless_it_says_otherwise(llm):
    """Strict, as vLLM's default (xgrammar's strict mode): a schema without `additionalProperties`
    took any other key, and a model that did not know the schema wrote keys of its own until
    max_tokens (`{"operation":"solve","expression":"answer_directly","expressionz Lovelace...`)."""
    tokenizer = llm.get_tokenizer()
    matcher = llm.engine.structured.matcher(StructuredOutputsParams(json=OPEN))
    assert matcher.consume_tokens(tokenizer.encode('{"n":1', add_special_tokens=False))
    logits = torch.zeros(1, llm.engine.model_config.vocab_size)
    structured_outputs.apply(logits, [matcher])
    allowed = [tokenizer.decode([t]) for t in (logits[0] == 0).nonzero().flatten().tolist()]
    assert "}" in allowed and any(t.startswith(",") for t in allowed)  # `,"tags"` may follow, no other key
    assert _accepts(llm, OPEN, '{"n":1,"tags":[{"t":"a"}]}')
    assert not _accepts(llm, OPEN, '{"n":1,"zz":2}')
    assert not _accepts(llm, OPEN, '{"n":1,"tags":[{"t":"a","zz":2}]}')  # nested objects too
    assert not _accepts(llm, json.dumps(OPEN), '{"n":1,"zz":2}')  # a schema given as text
    only_n = {"type": "object", "properties": {"n": {"type": "integer"}}}
    matcher = llm.engine.structured.matcher(StructuredOutputsParams(json=only_n))
    assert matcher.consume_tokens(tokenizer.encode('{"n":1', add_special_tokens=False))
    logits = torch.zeros(1, llm.engine.model_config.vocab_size)
    structured_outputs.apply(logits, [matcher])
    allowed = [tokenizer.decode([t]) for t in (logits[0] == 0).nonzero().flatten().tolist()]
    assert "}" in allowed and not any("," in t for t in allowed), allowed  # nothing may follow but the end


def test_a_schema_that_allows_other_keys_still_gets_them(llm):
    assert _accepts(llm, {**OPEN, "additionalProperties": True}, '{"n":1,"zz":2}')
    typed = {**OPEN, "additionalProperties": {"type": "integer"}}
    assert _accepts(llm, typed, '{"n":1,"zz":2}') and not _accepts(llm, typed, '{"n":1,"zz":"a"}')
    assert _accepts(llm, {"type": "object"}, '{"zz":2}')  # any object, as json_object asks for
    assert _accepts(llm, StructuredOutputsParams(json_object=True), '{"zz":2}')
    # llguidance's options still apply, and the schema stays strict under them
    flexible = {**OPEN, "x-guidance": {"whitespace_flexible": True}}
    assert _accepts(llm, flexible, '{ "n": 1 }') and not _accepts(llm, flexible, '{ "n": 1, "zz": 2 }')
    assert not _accepts(llm, OPEN, '{ "n": 1 }')
    # the parts of an allOf are left open (closing each would forbid the others' keys)
    parts = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert _accepts(llm, parts, '{"a":1,"b":2}')
