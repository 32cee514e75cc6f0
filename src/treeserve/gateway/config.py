"""What a gateway serves: model groups of backends, prices, fallbacks, keys and its database; from
command-line flags or a YAML file with the same fields (read by gateway/config_load.py), each value
checked as the dataclasses are made: an error names its field (and its model).

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

from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

from treeserve.arg_types import shown_userinfo, with_scheme, without_password
from treeserve.errors import ParamError

STRATEGIES = ("round_robin", "least_outstanding", "affinity")
DEFAULT_RESERVED_TOKENS = 4096
# what a backend URL starts with once checked (BackendConfig.check writes its scheme in lower case)
HTTP_SCHEMES, BROKER_SCHEMES = ("http://", "https://"), ("amqp://", "amqps://")
SCHEMES = ("http", "https", "amqp", "amqps")  # (any case: AMQP://host is amqp://host)


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
        """The URL without its user and password (`url_without_userinfo`): the backend's label in logs,
        metrics, spend rows and what key holders read (/model/info, /health, 503s); errors show the user."""
        return url_without_userinfo(self.url)

    def endpoint(self, path: str) -> str:
        """The URL of the backend's route `path` (`/v1/chat/completions`): after the URL's own path, before its
        query (a provider's `?api-version=...` or `?key=...` goes with every request; it was sent after the path
        joined to the query's last value)."""
        base, question, query = self.url.partition("?")
        return f"{base}{path}{question}{query}"

    def check(self, where: str) -> None:
        """Its values checked (a numeric string taken as its number), errors named `where`.FIELD."""
        url = with_scheme(self.url, SCHEMES) if isinstance(self.url, str) else None
        if url is None:
            url = redact_url(self.url) if isinstance(self.url, str) else self.url
            raise ParamError(f"{where}.url", f"expected http(s)://HOST:PORT (a server) or amqp://HOST (workers "
                             f"behind a RabbitMQ broker), got {url!r}")
        self.url = url  # (its scheme in lower case: the broker/HTTP split below and in Upstreams reads it)
        if self.api_key and self.url.startswith(HTTP_SCHEMES) and "@" in urlsplit(self.url).netloc:
            raise ParamError(f"{where}.api_key", f"backend {redact_url(self.url)}: a URL with a user and password and an "
                             "api_key cannot both be sent (aiohttp refuses every request): give one of them")
        for name in ("api_key", "model"):
            optional_text(getattr(self, name), f"{where}.{name}")
        for name in ("timeout", "connect_timeout"):  # (null: no limit, as aiohttp takes it)
            if getattr(self, name) is not None:
                setattr(self, name, number(getattr(self, name), f"{where}.{name}"))
        for name in ("continuous_usage", "priority"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(f"{where}.{name}", f"expected true or false, got {getattr(self, name)!r}")


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

    def __post_init__(self):
        where = f"models.{self.name}"
        for i, backend in enumerate(self.backends):
            backend.check(f"{where}.backends[{i}]")
        for name in ("input_cost_per_token", "output_cost_per_token"):
            setattr(self, name, number(getattr(self, name), f"{where}.{name}"))
        if self.max_tokens is not None:
            whole(self.max_tokens, f"{where}.max_tokens", minimum=1)
        if not isinstance(self.fallbacks, list) or not all(isinstance(f, str) for f in self.fallbacks):
            raise ParamError(f"{where}.fallbacks", f"expected a list of model names, got {self.fallbacks!r}")


@dataclass
class ChatConfig:
    """The web chat at /chat (`chat:` in the YAML file, or `--chat` and its flags)."""
    enabled: bool = False
    verifiers: dict[str, str] = field(default_factory=dict)  # generator -> its PRM: search mode for it
    router_model: str | None = None  # tools mode's function-calling model (default: the chat's own model)
    # the router is shown the conversation; false: the last message alone, for a router trained on one
    # message per prompt (the bundled arith-router: `treeserve chat` sets it false)
    router_history: bool = True
    tools: dict[str, str] = field(default_factory=dict)      # weather / wikipedia -> URL (GET ?q=...)
    tool_timeout: float = 10.0
    cookie_secure: bool = False      # mark the session cookie Secure (behind HTTPS)
    # model -> questions it answers well, [{"mode": chat|search|tools, "text": ...}]: the empty
    # conversation offers them (`treeserve chat` gives the bundled generator's)
    examples: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def check(self, models: dict) -> None:
        self.tool_timeout = number(self.tool_timeout, "chat.tool_timeout")
        if not isinstance(self.router_history, bool):
            raise ParamError("chat.router_history", f"expected true or false, got {self.router_history!r}")
        if isinstance(self.router_model, str) and not self.router_model.strip():  # (taken as none given)
            raise ParamError("chat.router_model", f"is empty ({self.router_model!r}): name a configured model, or "
                             "leave it out for the conversation's own")
        named = [*self.verifiers, *self.verifiers.values(), *([self.router_model] if self.router_model else [])]
        unknown = [m for m in named if m not in models]
        if unknown:
            raise ParamError("chat", f"model {unknown[0]!r} is not configured")
        self._check_examples(models)
        bad = sorted(set(self.tools) - {"weather", "wikipedia"})
        if bad:
            raise ParamError("chat.tools", f"unknown tool {bad[0]!r} (known: weather, wikipedia)")
        for name, url in self.tools.items():
            if not isinstance(url, str) or with_scheme(url, ("http", "https")) is None:
                raise ParamError(f"chat.tools.{name}", f"expected an http(s) URL, got {url!r}")
            self.tools[name] = with_scheme(url, ("http", "https"))

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
        for name, least in WHOLE_NUMBERS.items():
            whole(getattr(self, name), name, least)
        for name in SECONDS:
            setattr(self, name, number(getattr(self, name), name))
        for name in ("master_key", "database"):
            optional_text(getattr(self, name), name)
        if self.database is not None and not self.database.strip():  # (it was taken as none given)
            raise ParamError("database", f"is empty ({self.database!r}): give a SQLAlchemy URL, or leave it out "
                             "(then TREESERVE_GATEWAY_DATABASE, else ./treeserve-gateway.db)")
        if self.batch_priority is not None:
            whole(self.batch_priority, "batch_priority", minimum=-(1 << 31))
        if self.routing not in STRATEGIES:
            raise ParamError("routing", f"one of {', '.join(STRATEGIES)}, got {self.routing!r}")
        for model in self.models.values():
            unknown = [f for f in model.fallbacks if f not in self.models]
            if unknown:
                raise ParamError("fallbacks", f"fallbacks of {model.name!r}: no model {unknown[0]!r} is configured")


WHOLE_NUMBERS = {"retries": 0, "breaker_failures": 1, "batch_concurrency": 1}  # field -> its least value
SECONDS = ("health_interval", "breaker_cooldown", "key_cache_ttl", "shutdown_timeout")


def number(value: object, field: str) -> float:
    """A number >= 0. A numeric string is taken as its number: YAML 1.1 (PyYAML) reads 1e-6 as the
    string '1e-6'."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ParamError(field, f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ParamError(field, f"expected a number >= 0, got {value!r}")
    return value


def whole(value: object, field: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ParamError(field, f"expected a whole number >= {minimum}, got {value!r}")
    return value


def optional_text(value: object, field: str) -> None:
    if value is not None and not isinstance(value, str):
        raise ParamError(field, f"expected a string, got {value!r}")


def url_without_userinfo(url: str) -> str:
    """`url` with no user and no password: a label that stays the same whoever the backend signs in as and
    shows key holders no account name; one without a scheme as `redact_url` shows it."""
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:  # (a "/" in its password reads as a port: everything up to the last @ is userinfo)
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else redact_url(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return redact_url(url)
    return without_query_secrets(urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)))


def redact_url(url: str) -> str:
    """`url` as logs, metrics, spend rows and errors show it: its user kept, its password as *** (`amqp://alice:***@mq/`,
    as SQLAlchemy's `URL.render_as_string(hide_password=True)` shows a database's), a user with no password as
    *** (`https://***@host`: `TOKEN@host` is a key), its query's values as *** (`?api_key=***`); one urllib cannot
    split into a host (no scheme: `user:pw@host`; a port out of range) as arg_types.without_password shows it (an
    error names such a URL)."""
    return without_query_secrets(_without_password(url))


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        return without_password(url)
    if not parts.netloc:
        return without_password(url)
    userinfo, at, host = parts.netloc.rpartition("@")  # (as urllib splits it: a password may hold "@")
    if not at:
        return url
    user, _, password = userinfo.partition(":")
    netloc = f"{shown_userinfo(user, password)}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# query parameters that name no secret: shown as they are (Azure OpenAI's version; an amqp:// backend's
# connection settings, RabbitMQ's URI parameters and aio-pika's, so its metrics label stays as it was). Every
# other value is hidden: a list of secret-looking names would miss some (`code=`, `X-Amz-Signature=`,
# aio-pika's `keyfile_password=`).
SHOWN_QUERY = frozenset({"api-version", "api_version", "heartbeat", "connection_timeout", "connection_attempts",
                         "retry_delay", "socket_timeout", "channel_max", "frame_max", "reconnect_interval",
                         "fail_fast", "name"})


def without_query_secrets(url: str) -> str:
    """`url` with the value of each query parameter as *** (`?api_key=***`): a provider's key in the query
    (`key=`, `api-key=`, a signed URL's `sig=`) is as secret as a password; a parameter with no value
    (`?TOKEN`) as *** whole. Those of SHOWN_QUERY (`api-version`, `heartbeat`) are shown."""
    base, question, rest = url.partition("?")
    if not question:
        return url
    query, hash_mark, fragment = rest.partition("#")
    return f"{base}?{'&'.join(_shown_parameter(p) for p in query.split('&'))}{hash_mark}{fragment}"


def _shown_parameter(parameter: str) -> str:
    name, equals, _ = parameter.partition("=")
    if not parameter or (equals and name in SHOWN_QUERY):
        return parameter
    return f"{name}=***" if equals else "***"


def url_secrets(url: str) -> list[str]:
    """What `redact_url` hides of `url` (its password, a user with no password, its query's values), for
    scrubbing from a text that may quote the URL (an aiohttp error names the URL it requested)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    user, colon, password = userinfo.partition(":")
    found = [password] if password else [user] if user else []
    for name, equals, value in (p.partition("=") for p in parts.query.split("&")):
        if equals and name not in SHOWN_QUERY:
            found.append(value)
        elif name and not equals:  # `?TOKEN`: the whole parameter
            found.append(name)
    return sorted({s for s in found + [unquote(s) for s in found] if len(s) >= 4}, key=len, reverse=True)


def scrubbed(text: str, url: str) -> str:
    """`text` with each of `url`'s secrets as ***."""
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return text
