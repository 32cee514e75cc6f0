"""Parsing `--model NAME=PATH` arguments."""
from __future__ import annotations

from treeserve.model.registry import DEFAULT_GENERATOR


def named_models(values: list[str] | None) -> dict[str, str]:
    """`--model gen=PATH --model prm=PATH` (a bare PATH is named 'model')."""
    models = {}
    for value in values or [DEFAULT_GENERATOR]:
        name, sep, path = value.partition("=")
        if not sep or name.startswith("builtin"):
            name, path = "model", value
        if name in models:
            raise ValueError(f"model: the name {name!r} is given twice")
        models[name] = path
    return models
