"""Resolves a model argument: a local Hugging Face directory, or `builtin:NAME`.

Built-in models are either bundled in the package (`treeserve/models/NAME`, a Hugging Face
directory) or small random-weight models written on first use.
"""
from __future__ import annotations

import os
from pathlib import Path

from treeserve.errors import ParamError
from treeserve.model.random_models import BUILTIN_TINY_MODELS, make_tiny_model

BUILTIN_PREFIX = "builtin:"
# The trained arithmetic pair bundled in treeserve/models/ (scripts/train_arith.py writes it):
# the default generator, and the default verifier wherever one is needed.
DEFAULT_GENERATOR = "builtin:arith-gen"
DEFAULT_VERIFIER = "builtin:arith-prm"
# The bundled tool router (tools mode's function-calling model; Hermes-format calls).
DEFAULT_ROUTER = "builtin:arith-router"
# Served with no model named: the bundled generator and PRM, so /v1/search and /v1/rewards work too.
DEFAULT_PAIR = {"arith-gen": DEFAULT_GENERATOR, "arith-prm": DEFAULT_VERIFIER}
# What `treeserve chat` serves: the pair and the tool router, whose calls the hermes parser reads.
CHAT_MODELS = {**DEFAULT_PAIR, "arith-router": DEFAULT_ROUTER}
CHAT_TOOL_PARSER = "hermes"
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "models"


def cache_dir() -> Path:
    root = os.environ.get("TREESERVE_CACHE") or Path.home() / ".cache" / "treeserve"
    return Path(root)


def resolve_model_path(model: str | Path, param: str = "model") -> Path:
    """`param`: the argument an error names (`model`, or `tokenizer` for a tokenizer's folder)."""
    name = str(model)
    if not name.strip():  # (Path('') is the current folder)
        raise ParamError(param, f"is empty ({name!r}): give a local model directory or builtin:NAME")
    if name.startswith(BUILTIN_PREFIX):
        return _builtin(name[len(BUILTIN_PREFIX):], param)
    path = Path(name).expanduser()
    if not path.is_dir():
        hint = f"; did you mean {BUILTIN_PREFIX}{name}?" if name in builtin_names() else ""
        raise FileNotFoundError(f"{param}: {name!r} is not a local directory (nothing is downloaded from a hub){hint}")
    return path


def served_name(model: str | Path) -> str:
    """The name a model is served under unless one is given: NAME for `builtin:NAME` (as
    `treeserve serve` names the bundled pair), the argument itself for a directory (as vLLM does)."""
    return str(model).removeprefix(BUILTIN_PREFIX)


def _builtin(name: str, param: str = "model") -> Path:
    if (BUNDLED_DIR / name / "config.json").is_file():
        return BUNDLED_DIR / name
    if name not in BUILTIN_TINY_MODELS:
        raise ParamError(param, f"unknown built-in model {name!r}; available: {', '.join(builtin_names())}")
    path = cache_dir() / "builtin" / name
    if not (path / "config.json").is_file():
        family, overrides = BUILTIN_TINY_MODELS[name]
        make_tiny_model(family, path, seed=0, **overrides)
    return path


def builtin_names() -> list[str]:
    bundled = [p.parent.name for p in BUNDLED_DIR.glob("*/config.json")]
    return sorted([*bundled, *BUILTIN_TINY_MODELS])


def given_name(value: str) -> str | None:
    """The NAME of `--model NAME=PATH` (None for a bare path, builtin:NAME included)."""
    name, sep, _ = value.partition("=")
    return None if not sep or name.startswith("builtin") else name


def named_models(values: list[str] | None) -> dict[str, str]:
    """`--model gen=PATH --model prm=PATH` (a bare PATH is named `served_name(PATH)`; none: the
    default generator)."""
    models = {}
    for value in values or [DEFAULT_GENERATOR]:
        name, path = (value.split("=", 1) if given_name(value) is not None else (served_name(value), value))
        name, path = name.strip(), path.strip()
        if not name or not path:
            missing = "a name before" if not name else "a path after"
            raise ParamError("model", f"{value!r}: NAME=PATH needs {missing} '=' (e.g. gen=builtin:arith-gen)")
        if name in models:
            raise ParamError("model", f"the name {name!r} is given twice")
        models[name] = path
    return models
