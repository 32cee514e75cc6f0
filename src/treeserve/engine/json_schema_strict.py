"""JSON schemas in strict mode: an object lists every key it may have, unless it says otherwise.

JSON Schema's own default (`additionalProperties` absent means any other key is allowed) lets a
model that does not know the schema write keys of its own, of any length, until max_tokens. vLLM's
default grammar engine for a JSON schema (xgrammar, chosen by `backend: auto`) compiles in strict
mode: an object that lists `properties` takes no other key unless its schema allows them
(`additionalProperties: true` or a schema), nor an array with `prefixItems` more items than it
lists unless `items` says so. llguidance has no such option, so the schema is rewritten before
it compiles, as vLLM's own llguidance backend does with `disable_additional_properties`. A bare
`{"type": "object"}` (what `json_object` asks for) still takes any keys, as in xgrammar.
docs/STRUCTURED_OUTPUTS.md has the sources.
"""
from __future__ import annotations

import json

# keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_DEFS = ("$defs", "definitions")  # (a `$ref` names one of these: "#/$defs/name")
# keywords whose value is a subschema or a list of them
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
               "anyOf", "oneOf", "allOf")
_BRANCHES = ("anyOf", "oneOf")


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` whose objects take only the keys they list, unless they say otherwise."""
    open_refs: set[str] = set()  # `$ref`s merged with other keys somewhere: their targets stay open
    while True:  # (a target left open can merge further `$ref`s of its own: until none is new)
        seen = set(open_refs)
        out = _strict(schema, "#" in open_refs, open_refs)
        if open_refs == seen:
            return out


def strict_schema_text(text: str) -> str:
    """`strict_schema` of a schema given as JSON text; text that is not a JSON object is returned as
    given (the grammar engine then says what is wrong with it)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(strict_schema(schema)) if isinstance(schema, dict) else text


def _strict(schema, merged: bool, open_refs: set[str]):
    """`merged`: the schema's keys are intersected with others' (an `allOf`'s part, a `$ref`'s target
    or an `anyOf`/`oneOf` branch beside keys of their own): closing it would forbid theirs, so it (and
    a schema that merges keys of its own with such parts) is left open as written; the schemas
    inside it are still closed. `open_refs` gathers the `$ref`s met where they merge."""
    if isinstance(schema, list):
        return [_strict(item, merged, open_refs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    merges = _merges(schema)
    if (merged or merges) and isinstance(schema.get("$ref"), str):
        open_refs.add(schema["$ref"])
    out = {}
    for key, value in schema.items():
        if key in _DEFS and isinstance(value, dict):
            out[key] = {name: _strict(sub, f"#/{key}/{name}" in open_refs, open_refs) for name, sub in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _strict(sub, False, open_refs) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = _strict(value, key == "allOf" or (key in _BRANCHES and (merged or merges)), open_refs)
        else:
            out[key] = value
    if not merged and not merges:
        _close(out)
    return out


def _close(schema: dict) -> None:
    """Closes an object that lists its keys (a key it requires but does not list is listed, with any
    value, rather than made impossible), and an array that lists its items (`prefixItems`)."""
    if "prefixItems" in schema and "items" not in schema and "unevaluatedItems" not in schema:
        schema["items"] = False
    if not _lists_keys(schema) or "additionalProperties" in schema or "unevaluatedProperties" in schema:
        return
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    missing = [key for key in required if isinstance(key, str) and key not in schema.get("properties", {})]
    if missing and "patternProperties" in schema:
        return  # (whether the patterns take it is the grammar engine's to say: left open)
    if missing:
        schema["properties"] = {**schema["properties"], **{key: {} for key in missing}}
    schema["additionalProperties"] = False


def _merges(schema: dict) -> bool:
    """Whether the schema lists keys that merge with other schemas' (a `$ref`'s, an `allOf`'s, or
    `anyOf`/`oneOf` branches that list keys of their own)."""
    if not _lists_keys(schema):
        return False
    if "$ref" in schema or "allOf" in schema:
        return True
    branches = [b for key in _BRANCHES if isinstance(schema.get(key), list) for b in schema[key]]
    return any(isinstance(b, dict) and (_lists_keys(b) or "$ref" in b or "allOf" in b) for b in branches)


def _lists_keys(schema: dict) -> bool:
    return isinstance(schema.get("properties"), dict) or isinstance(schema.get("patternProperties"), dict)
