"""What a gateway serves: model groups of backends, prices, fallbacks, keys and its database; from
command-line flags or a YAML file with the same fields.

    master_key: sk-admin-...            # or TREESERVE_MASTER_KEY
    database: postgresql+psycopg://gateway@db/gateway   # default: SQLite in the working directory
    routing: least_outstanding          # round_robin | least_outstanding | affinity
    models:
      arith-gen:
        backends: [http://10.0.0.1:8000, http://10.0.0.2:8000]
        input_cost_per_token: 0.0000002
        output_cost_per_token: 0.0000006
        fallbacks: [other-model]
      gpt-4o-mini:
        backends: [{url: https://api.openai.com, api_key: sk-..., model: gpt-4o-mini}]
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import yaml

from treeserve.errors import ParamError

STRATEGIES = ("round_robin", "least_outstanding", "affinity")
DEFAULT_RESERVED_TOKENS = 4096
HTTP_SCHEMES, BROKER_SCHEMES = ("http://", "https://"), ("amqp://", "amqps://")


@dataclass
class BackendConfig:
    url: str                      # the server's root (its routes are /v1/...), or amqp://: a broker's workers
    api_key: str | None = None    # sent upstream as the bearer key (an external provider's own key)
    model: str | None = None      # the model's name at this backend, when it differs from the gateway's
    timeout: float = 600.0        # seconds for a whole non-streamed answer, or between streamed chunks
    connect_timeout: float = 5.0
    continuous_usage: bool = True  # ask for usage in every streamed chunk (vLLM's and treeserve's option)
    priority: bool = True         # send a request's `priority` (treeserve's; vLLM's with --scheduling-policy priority)

    @property
    def name(self) -> str:
        """The URL without its user and password: what logs, metrics and spend rows show."""
        return redact_url(self.url)


@dataclass
class ModelConfig:
    name: str
    backends: list[BackendConfig]
    input_cost_per_token: float = 0.0
    output_cost_per_token: float = 0.0
    # A request that names no max_tokens gets this one (sent upstream, so its reservation holds);
    # unset, such a request reserves DEFAULT_RESERVED_TOKENS and the backend's own default applies.
    max_tokens: int | None = None
    fallbacks: list[str] = field(default_factory=list)


@dataclass
class ChatConfig:
    """The web chat at /chat (`chat:` in the YAML file, or `--chat` and its flags)."""
    enabled: bool = False
    verifiers: dict[str, str] = field(default_factory=dict)  # generator -> its PRM: search mode for it
    router_model: str | None = None  # tools mode's function-calling model (default: the chat's own model)
    tools: dict[str, str] = field(default_factory=dict)      # weather / wikipedia -> URL (GET ?q=...)
    tool_timeout: float = 10.0
    cookie_secure: bool = False      # mark the session cookie Secure (behind HTTPS)
    # model -> questions it answers well, [{"mode": chat|search|tools, "text": ...}]: the empty
    # conversation offers them (`treeserve chat` gives the bundled generator's)
    examples: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def check(self, models: dict) -> None:
        named = [*self.verifiers, *self.verifiers.values(), *([self.router_model] if self.router_model else [])]
        unknown = [m for m in named if m not in models]
        if unknown:
            raise ParamError("chat", f"model {unknown[0]!r} is not configured")
        self._check_examples(models)
        bad = sorted(set(self.tools) - {"weather", "wikipedia"})
        if bad:
            raise ParamError("chat.tools", f"unknown tool {bad[0]!r} (known: weather, wikipedia)")
        for name, url in self.tools.items():
            if not url.startswith(HTTP_SCHEMES):
                raise ParamError(f"chat.tools.{name}", f"expected an http(s) URL, got {url!r}")

    def _check_examples(self, models: dict) -> None:
        for model, examples in self.examples.items():
            if model not in models:
                raise ParamError("chat.examples", f"model {model!r} is not configured")
            for example in examples:
                if not isinstance(example, dict) or example.get("mode") not in ("chat", "search", "tools") \
                        or not isinstance(example.get("text"), str) or not example["text"].strip():
                    raise ParamError(f"chat.examples.{model}", f"each example needs a mode (chat, search or "
                                     f"tools) and a text, got {example!r}")
                if example["mode"] == "search" and model not in self.verifiers:
                    raise ParamError(f"chat.examples.{model}", "a search example needs a verifier for the model "
                                     "(chat.verifiers)")


@dataclass
class GatewayConfig:
    models: dict[str, ModelConfig]
    master_key: str | None = None
    database: str | None = None
    routing: str = "least_outstanding"
    retries: int = 2              # further backends tried before a first byte reached the client
    health_interval: float = 5.0  # seconds between active health checks of each backend (0: none)
    breaker_failures: int = 3     # consecutive failures that open a backend's circuit
    breaker_cooldown: float = 10.0  # seconds an open circuit waits before one trial request
    key_cache_ttl: float = 2.0    # seconds a process trusts a key it checked (another process's delete or
                                  # block takes effect within it; budgets and limits are always live)
    shutdown_timeout: float = 30.0  # seconds a stopping gateway lets its requests in flight finish
    batch_concurrency: int = 8    # a process's batch lines in flight at once, over all its batches
    batch_priority: int | None = 1  # the `priority` batch lines ask their server for (None: not sent; a vLLM
                                    # backend takes it only with --scheduling-policy priority)
    chat: ChatConfig = field(default_factory=ChatConfig)

    @property
    def priced(self) -> bool:
        """Whether any model has a price: without one every request costs 0 and no max_budget acts."""
        return any(m.input_cost_per_token or m.output_cost_per_token for m in self.models.values())

    def __post_init__(self):
        if isinstance(self.chat, dict):
            self.chat = ChatConfig(**self.chat)
        self.chat.check(self.models)
        if not isinstance(self.batch_concurrency, int) or self.batch_concurrency < 1:
            raise ParamError("batch_concurrency", f"must be >= 1, got {self.batch_concurrency!r}")
        if self.routing not in STRATEGIES:
            raise ParamError("routing", f"one of {', '.join(STRATEGIES)}, got {self.routing!r}")
        for model in self.models.values():
            unknown = [f for f in model.fallbacks if f not in self.models]
            if unknown:
                raise ParamError("fallbacks", f"fallbacks of {model.name!r}: no model {unknown[0]!r} is configured")


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def parse_backend_flags(values: list[str]) -> dict[str, ModelConfig]:
    """`--backend MODEL=URL`, repeatable; several URLs for one model are its replicas."""
    models: dict[str, ModelConfig] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url.startswith(HTTP_SCHEMES + BROKER_SCHEMES):
            raise ParamError("backend", f"--backend: expected MODEL=http(s)://HOST:PORT (a server) or "
                             f"MODEL=amqp://HOST (workers behind a RabbitMQ broker), got {value!r}")
        models.setdefault(name, ModelConfig(name, [])).backends.append(BackendConfig(url.rstrip("/")))
    return models


def load_yaml(path: Path) -> dict:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ParamError("config", f"{path}: expected a mapping at the top level")
    models = {}
    for name, spec in (data.pop("models", None) or {}).items():
        spec = dict(spec or {})
        backends = [BackendConfig(**({"url": b} if isinstance(b, str) else b)) for b in spec.pop("backends", [])]
        for backend in backends:
            backend.url = backend.url.rstrip("/")
        models[name] = ModelConfig(name, backends, **spec)
    data["models"] = models
    return data


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
