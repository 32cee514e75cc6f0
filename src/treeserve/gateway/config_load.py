"""Where a gateway's configuration comes from: `--backend` flags and a YAML file (gateway/config.py
has its fields). The file's shape is checked here (a key given twice, an unknown key, a section of
the wrong kind, a syntax error: each a one-line ParamError), its values by the dataclasses."""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import yaml

from treeserve.arg_types import with_scheme, without_password
from treeserve.errors import ParamError
from treeserve.gateway.config import SCHEMES, BackendConfig, ChatConfig, GatewayConfig, ModelConfig


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently: a model defined twice would lose its first definition)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # (`<<: *anchor`: its keys are merged by PyYAML; only keys written here are compared)
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_backend_flags(values: list[str]) -> dict[str, ModelConfig]:
    """`--backend MODEL=URL`, repeatable; several URLs for one model are its replicas."""
    models: dict[str, ModelConfig] = {}
    for value in values:
        name, sep, given = value.partition("=")
        url = with_scheme(given, SCHEMES)  # (any case: HTTP://host is http://host)
        if not sep or not name or url is None:
            raise ParamError("backend", f"--backend: expected MODEL=http(s)://HOST:PORT (a server) or "
                             f"MODEL=amqp://HOST (workers behind a RabbitMQ broker), got {without_password(value)!r}")
        models.setdefault(name, ModelConfig(name, [])).backends.append(BackendConfig(url.rstrip("/")))
    return models


def load_yaml(path: Path) -> dict:
    data = _mapping(_read(path) or {}, "config")
    _known(data, GatewayConfig, "config")
    if data.get("chat"):
        _known(_mapping(data["chat"], "chat"), ChatConfig, "chat")
    data["models"] = {name: _model(name, spec) for name, spec in _mapping(data.get("models") or {}, "models").items()}
    return data


def _read(path: Path) -> object:
    try:
        return yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except OSError as exc:
        raise ParamError("config", f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ParamError("config", f"{path}: {where}{' '.join(problem.split())}") from None


def _model(name: object, spec: object) -> ModelConfig:
    where = f"models.{name}"
    if not isinstance(name, str):
        raise ParamError(where, f"a model's name must be a string, got {name!r}")
    spec = dict(_mapping(spec or {}, where))
    _known(spec, ModelConfig, where, own=("name",))
    backends = spec.pop("backends", [])
    if not isinstance(backends, list):
        raise ParamError(f"{where}.backends", f"expected a list of URLs or {{url: ...}} mappings, got {backends!r}")
    return ModelConfig(name, [_backend(b, f"{where}.backends[{i}]") for i, b in enumerate(backends)], **spec)


def _backend(spec: object, where: str) -> BackendConfig:
    if isinstance(spec, str):
        spec = {"url": spec}
    _known(_mapping(spec, where), BackendConfig, where)
    if not isinstance(spec.get("url"), str):
        raise ParamError(f"{where}.url", f"expected a URL, got {spec.get('url')!r}")
    return BackendConfig(**spec | {"url": spec["url"].rstrip("/")})


def _mapping(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ParamError(where, f"expected a mapping (key: value lines), got a {type(value).__name__}")
    return value


def _known(section: dict, cls: type, where: str, own: tuple[str, ...] = ()) -> None:
    """`section`'s keys are fields of `cls` (not its `own`: those the loader sets)."""
    known = [f.name for f in fields(cls) if f.name not in own]
    unknown = [key for key in section if key not in known]
    if unknown:
        raise ParamError(where, f"unknown key {unknown[0]!r} (known: {', '.join(known)})")


def build_config(backends: list[str] | None = None, config_file: Path | None = None, **overrides) -> GatewayConfig:
    """Flags override the file; the master key may also come from TREESERVE_MASTER_KEY."""
    data = load_yaml(config_file) if config_file else {"models": {}}
    for name, model in parse_backend_flags(backends or []).items():
        if name in data["models"]:
            data["models"][name].backends.extend(model.backends)
        else:
            data["models"][name] = model
    chat = overrides.pop("chat", None)
    if chat is not None:  # flags add to the file's chat section
        section = dict(data.get("chat") or {})
        for name in ("verifiers", "tools", "examples"):
            chat[name] = {**(section.get(name) or {}), **chat.get(name, {})}
        chat["router_model"] = chat["router_model"] or section.get("router_model")
        data["chat"] = {**section, **chat}
    data.update({k: v for k, v in overrides.items() if v is not None})
    data.setdefault("master_key", os.environ.get("TREESERVE_MASTER_KEY"))
    if not data["models"]:
        raise ParamError("backend", "no backends: give --backend MODEL=URL (repeatable) or a --config file")
    for model in data["models"].values():
        if not model.backends:
            raise ParamError("backend", f"model {model.name!r} has no backends")
    return GatewayConfig(**data)
