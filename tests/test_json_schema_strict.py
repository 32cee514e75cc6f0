"""Strict mode's rewrite of JSON schemas (engine/json_schema_strict.py) on the shapes where closing
every object naively would make a valid schema impossible, checked on llguidance's own grammars."""
import copy
import json

import llguidance
import llguidance.hf
import pytest

from treeserve.engine.json_schema_strict import strict_schema, strict_schema_text
from treeserve.model.random_models import train_tokenizer


@pytest.fixture(scope="module")
def accepts():
    tokenizer = train_tokenizer(512)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])

    def accepts(schema: dict, text: str) -> bool:
        """Whether the strict grammar of `schema` compiles and takes all of `text` as a whole answer."""
        grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_schema_text(json.dumps(schema)),
                                                                defaults={"whitespace_flexible": False})
        assert not llguidance.LLMatcher.validate_grammar(grammar, lltok)
        matcher = llguidance.LLMatcher(lltok, grammar)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    return accepts


BASE = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def test_a_required_key_the_properties_do_not_list_stays_possible(accepts):
    """It was made impossible (a 400: "required property 'b' is unsatisfiable"); it is listed, with
    any value, and other keys stay out."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert accepts(schema, '{"a":1,"b":"x"}')
    assert not accepts(schema, '{"a":1,"b":2,"c":3}')


def test_a_ref_merged_with_keys_of_its_own_stays_open(accepts):
    """`$ref` beside `properties`, or in an `allOf` beside another part: its target's keys and the
    others' go together (its target was closed, and the schema was a 400); a plain `$ref` to the
    same kind of object is still closed."""
    beside = {"$defs": {"base": BASE}, "$ref": "#/$defs/base", "properties": {"y": {"type": "integer"}},
              "required": ["y"]}
    assert accepts(beside, '{"x":1,"y":2}')
    parts = {"definitions": {"base": BASE},
             "allOf": [{"$ref": "#/definitions/base"}, {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]}
    assert accepts(parts, '{"x":1,"y":2}')
    plain = {"$defs": {"base": BASE}, "type": "object", "properties": {"b": {"$ref": "#/$defs/base"}}}
    assert accepts(plain, '{"b":{"x":1}}') and not accepts(plain, '{"b":{"x":1,"z":2}}')


def test_anyof_branches_beside_keys_of_their_own_are_merged_not_closed(accepts):
    """A discriminated object (shared `properties` and one `anyOf` branch each) was a 400; branches
    alone (no keys beside them) are each closed."""
    schema = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
              "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                        {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]}
    assert accepts(schema, '{"kind":"a","x":1}') and accepts(schema, '{"kind":"b","y":1}')
    alone = {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                       {"type": "object", "properties": {"y": {"type": "integer"}}}]}
    assert accepts(alone, '{"x":1}') and not accepts(alone, '{"x":1,"z":2}')


def test_prefix_items_take_no_more_items(accepts):
    """As xgrammar's strict mode ("no properties and items that are not specified"): a tuple without
    `items` took any number of items more."""
    schema = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert accepts(schema, '[1,"a"]') and not accepts(schema, '[1,"a",3]')
    assert accepts({**schema, "items": {"type": "integer"}}, '[1,"a",3]')


def test_the_schema_given_is_not_changed():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}, "required": ["a", "b"],
              "$defs": {"base": BASE}, "allOf": [{"$ref": "#/$defs/base"}], "prefixItems": [True]}
    before = copy.deepcopy(schema)
    strict_schema(schema)
    assert schema == before
    assert strict_schema_text("true") == "true" and strict_schema_text("{not json") == "{not json"
