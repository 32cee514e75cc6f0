"""Which backend serves a request: model groups of replicas, a circuit breaker per backend, and
three strategies (round robin, least outstanding requests, affinity by a consistent hash).

Affinity uses rendezvous hashing: each request key ranks the replicas by hash(key, replica) and
takes the best usable one, so a conversation stays on one replica (its KV stays cached there) and
a replica that goes away moves only its own conversations."""
from __future__ import annotations

import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field

from treeserve.gateway.config import BackendConfig, GatewayConfig, ModelConfig


@dataclass
class CircuitBreaker:
    """Closed: requests flow. `failures` consecutive failures open it for `cooldown` seconds; then
    one trial request is let through (half-open): its success closes it, its failure reopens it."""
    failures: int
    cooldown: float
    consecutive: int = 0
    open_until: float = 0.0
    trial_in_flight: bool = False

    @property
    def state(self) -> str:
        if self.consecutive < self.failures:
            return "closed"
        return "open" if time.monotonic() < self.open_until or self.trial_in_flight else "half_open"

    def allows(self) -> bool:
        return self.state != "open"

    def on_start(self) -> None:
        if self.state == "half_open":
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.consecutive, self.trial_in_flight = 0, False

    def reopens_in(self) -> float:
        """Seconds until an open circuit lets its trial request through (0 when it is not open)."""
        return max(0.0, self.open_until - time.monotonic()) if self.state == "open" else 0.0

    def on_failure(self) -> None:
        self.consecutive += 1
        self.trial_in_flight = False
        if self.consecutive >= self.failures:
            self.open_until = time.monotonic() + self.cooldown


@dataclass
class Backend:
    config: BackendConfig
    model: str
    breaker: CircuitBreaker
    healthy: bool = True          # the last active health check's verdict
    outstanding: int = 0          # requests sent and not finished
    last_error: str | None = None
    queue_depth: int | None = None  # a broker backend's waiting requests and workers, at its last check
    consumers: int | None = None
    probe: str | None = None      # the health check's path, once found (gateway/health.py)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def name(self) -> str:
        return self.config.name

    def endpoint(self, path: str) -> str:
        return self.config.endpoint(path)

    @property
    def usable(self) -> bool:
        return self.healthy and self.breaker.allows()

    @property
    def cut_off(self) -> bool:
        """Failing its health check with its circuit open: both say it is down, so no request is sent to
        it (a connect timeout each, where its host does not answer) until one of them says otherwise: the
        health check passes, or the cooldown ends and one trial request goes (LiteLLM's cooldown)."""
        return not self.healthy and self.breaker.state == "open"


@dataclass
class ModelGroup:
    config: ModelConfig
    backends: list[Backend]
    _turn: itertools.count = field(default_factory=itertools.count)

    def ranked(self, strategy: str, affinity_key: str | None) -> list[Backend]:
        """The usable backends in the order to try them; unusable ones last (a last resort when all
        are marked down: a stale health verdict should not refuse traffic outright)."""
        usable = [b for b in self.backends if b.usable]
        rest = [b for b in self.backends if not b.usable]
        start = next(self._turn)
        rotated = usable[start % len(usable):] + usable[:start % len(usable)] if usable else []
        if strategy == "least_outstanding":
            rotated.sort(key=lambda b: b.outstanding)  # stable: ties keep the round-robin order
        elif strategy == "affinity" and affinity_key is not None:
            rotated.sort(key=lambda b: _rendezvous(affinity_key, b.url), reverse=True)
            rest.sort(key=lambda b: _rendezvous(affinity_key, b.url), reverse=True)
        return rotated + rest


class Router:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.groups = {
            name: ModelGroup(model, [Backend(b, name, CircuitBreaker(config.breaker_failures, config.breaker_cooldown))
                                     for b in model.backends])
            for name, model in config.models.items()}

    def chain(self, model: str) -> list[str]:
        """The model, then its fallbacks (each once)."""
        return list(dict.fromkeys([model, *self.groups[model].config.fallbacks]))

    def plan(self, model: str, affinity_key: str | None, attempts: int) -> list[tuple[str, Backend]]:
        """(model, backend) pairs to try in order: up to `attempts` of the model's replicas, then as
        many of each fallback's (LiteLLM counts fallbacks apart from its retries). A group with fewer
        replicas goes round them again: a kept-alive connection its server just closed fails once.
        Those of them that are not usable (failing their health check, their circuit open) come after
        every usable one, the fallbacks' included: the last resort they are (LiteLLM's cooldown leaves
        such a deployment out and goes to the fallbacks), not 1 + retries waits on a dead replica (a
        connect timeout each, where its host does not answer) before every request reaches a fallback.
        Those cut off (both at once) are not tried at all: `unavailable` says why."""
        tries = [(name, b) for name in self.chain(model)
                 for b in itertools.islice(itertools.cycle(
                     [b for b in self.groups[name].ranked(self.config.routing, affinity_key) if not b.cut_off]),
                     attempts)]
        return [t for t in tries if t[1].usable] + [t for t in tries if not t[1].usable]

    def unavailable(self, model: str) -> tuple[str, int]:
        """Why `model` (its fallbacks too) has no backend to try, and in how many seconds one may be tried
        again (its first circuit's trial; 1 when none is due)."""
        cut = [b for name in self.chain(model) for b in self.groups[name].backends if b.cut_off]
        if not cut:
            return "no backend is configured", 1
        reasons = "; ".join(b.last_error or f"{b.name}: down" for b in cut)  # (an error names its backend)
        wait = max(1, math.ceil(min(b.breaker.reopens_in() for b in cut)))
        return (f"each backend fails its health check and has its circuit open, not tried again for {wait} s "
                f"({reasons})"), wait

    def backends(self) -> list[Backend]:
        return [b for group in self.groups.values() for b in group.backends]


def _rendezvous(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest(), "big")


def affinity_key(body: dict) -> str | None:
    """The `user` field, else the conversation's opening (system prompt and first user turn) or the
    prompt's first 512 characters: what a replica's prefix cache would reuse."""
    if isinstance(body.get("user"), str) and body["user"]:
        return "user:" + body["user"]
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        opening = [m for m in messages[:2] if isinstance(m, dict)]
        return "chat:" + repr([(m.get("role"), m.get("content")) for m in opening])
    prompt = body.get("prompt") or body.get("problem")
    if isinstance(prompt, str):
        return "prompt:" + prompt[:512]
    return None
