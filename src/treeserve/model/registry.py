"""Resolves a model argument: a local Hugging Face directory, or `builtin:NAME`."""
from __future__ import annotations

import os
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
DEFAULT_MODEL = "builtin:tiny-random-llama"


def cache_dir() -> Path:
    root = os.environ.get("TREESERVE_CACHE") or Path.home() / ".cache" / "treeserve"
    return Path(root)


def resolve_model_path(model: str | Path) -> Path:
    name = str(model)
    if name.startswith(BUILTIN_PREFIX):
        return _builtin(name[len(BUILTIN_PREFIX):])
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model: {name!r} is not a local directory (nothing is downloaded from a hub)")
    return path


def _builtin(name: str) -> Path:
    from treeserve.testing.tiny_models import BUILTIN_TINY_MODELS, make_tiny_model

    if name not in BUILTIN_TINY_MODELS:
        raise ValueError(f"model: unknown built-in model {name!r}; available: {', '.join(sorted(BUILTIN_TINY_MODELS))}")
    path = cache_dir() / "builtin" / name
    if not (path / "config.json").is_file():
        family, overrides = BUILTIN_TINY_MODELS[name]
        make_tiny_model(family, path, seed=0, **overrides)
    return path
