"""JSON schemas in strict mode: an object lists every key it may have, unless it says otherwise.

JSON Schema's own default (`additionalProperties` absent means any other key is allowed) lets a
model that does not know the schema write keys of its own, of any length, until max_tokens. vLLM's
default grammar engine for a JSON schema (xgrammar, chosen by `backend: auto`) compiles in strict
mode: an object that lists `properties` takes no other key unless its schema allows them
(`additionalProperties: true` or a schema; `unevaluatedProperties`). llguidance has no such option,
so the schema is rewritten before it compiles, as vLLM's own llguidance backend does with
`disable_additional_properties`. A bare `{"type": "object"}` (what `json_object` asks for) still
takes any keys, as in xgrammar. docs/STRUCTURED_OUTPUTS.md has the sources.
"""
from __future__ import annotations

import json

# keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose value is a subschema or a list of them
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
               "anyOf", "oneOf", "allOf")


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` whose objects take only the keys they list, unless they say otherwise."""
    return _strict(schema, merged=False)


def strict_schema_text(text: str) -> str:
    """`strict_schema` of a schema given as JSON text; text that is not a JSON object is returned as
    given (the grammar engine then says what is wrong with it)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(strict_schema(schema)) if isinstance(schema, dict) else text


def _strict(schema, merged: bool):
    """`merged`: the schema is one of an `allOf`'s, whose keys the grammar engine intersects with
    its siblings': closing it would forbid theirs, so it (and a schema with `allOf` or a `$ref`
    beside its own keys) is left open as written; the schemas inside it are still closed."""
    if isinstance(schema, list):
        return [_strict(item, merged) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _strict(sub, False) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = _strict(value, key == "allOf")
        else:
            out[key] = value
    if _lists_keys(out) and not merged and "allOf" not in out and "$ref" not in out \
            and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lists_keys(schema: dict) -> bool:
    return isinstance(schema.get("properties"), dict) or isinstance(schema.get("patternProperties"), dict)
