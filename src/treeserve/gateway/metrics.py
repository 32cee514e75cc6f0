"""The gateway's Prometheus metrics (`treeserve_gateway:` prefix), per backend and per key. A key
is labelled by its alias or its display name (`sk-...abcd`), never by its secret."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)


class GatewayMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "treeserve_gateway:"
        self.requests = Counter(f"{p}requests", "Requests answered, by model, backend and HTTP status",
                                ["model", "backend", "status"], registry=r)
        self.backend_up = Gauge(f"{p}backend_up", "1 if the backend passed its last health check", ["backend"],
                                registry=r)
        self.backend_outstanding = Gauge(f"{p}backend_outstanding_requests", "Requests sent and not finished",
                                         ["backend"], registry=r)
        self.backend_failures = Counter(f"{p}backend_failures", "Failed attempts on a backend, by reason",
                                        ["backend", "reason"], registry=r)
        self.breaker_open = Gauge(f"{p}backend_circuit_open", "1 while the backend's circuit breaker is open",
                                  ["backend"], registry=r)
        self.queue_messages = Gauge(f"{p}broker_queue_messages", "Requests waiting in a broker backend's queue",
                                    ["backend", "model"], registry=r)
        self.queue_consumers = Gauge(f"{p}broker_queue_consumers", "Workers consuming a broker backend's queue",
                                     ["backend", "model"], registry=r)
        self.retries = Counter(f"{p}retries", "Attempts moved to another backend before a first byte",
                               ["model"], registry=r)
        self.key_requests = Counter(f"{p}key_requests", "Requests by key and outcome", ["key", "outcome"],
                                    registry=r)
        self.key_tokens = Counter(f"{p}key_tokens", "Tokens billed by key, model and kind",
                                  ["key", "model", "kind"], registry=r)
        self.key_spend = Counter(f"{p}key_spend", "Spend billed by key (the price table's currency)", ["key"],
                                 registry=r)
        self.latency = Histogram(f"{p}request_duration_seconds", "Whole request, gateway in to last byte out",
                                 ["model"], buckets=BUCKETS, registry=r)
        self.ttft = Histogram(f"{p}time_to_first_chunk_seconds", "Streamed requests: gateway in to first chunk out",
                              ["model"], buckets=BUCKETS, registry=r)

        self.chat_sign_ins = Counter(f"{p}chat_sign_ins", "Web chat sign-in attempts by outcome "
                                     "(ok, refused, throttled)", ["outcome"], registry=r)
        self.chat_messages = Counter(f"{p}chat_messages", "Web chat answers by mode and how they ended "
                                     "(done, error, stopped)", ["mode", "status"], registry=r)
        self.chat_restarts = Counter(f"{p}chat_restarts", "Web chat messages answered again: a user's message "
                                     "edited (edit) or its answer regenerated (regenerate)", ["action"], registry=r)
        self.chat_tool_calls = Counter(f"{p}chat_tool_calls", "Tools mode's tool runs by tool and outcome",
                                       ["tool", "outcome"], registry=r)

        self.batch_lines = Counter(f"{p}batch_lines", "Batch lines sent, by outcome (answered: a backend's "
                                   "answer, refused: the gateway's error, retried: no backend could answer, "
                                   "waited: a rate limit, or a budget that requests in flight hold)", ["outcome"],
                                   registry=r)
        self.batches = Counter(f"{p}batches", "Batches ended by this process, by how (completed, cancelled, "
                               "expired)", ["status"], registry=r)

        self.heartbeats = Counter(f"{p}heartbeats", "This process's heartbeats by outcome (ok, failed, withheld: "
                                  "its event loop stuck)", ["outcome"], registry=r)
        self.suspended = Counter(f"{p}suspended_seconds", "Seconds this process was seen suspended (SIGSTOP, a "
                                 "paused container, a suspended machine: neither its event loop nor its heartbeat "
                                 "ran; not counted as its loop stuck)", registry=r)
        self.heartbeat_age = Gauge(f"{p}heartbeat_age_seconds", "Seconds since this process's last heartbeat was "
                                   "committed (past 60, another process gives back what it holds)", registry=r)
        self.writer_busy = Gauge(f"{p}settlement_writer_busy_seconds", "Seconds the settlement writer's database "
                                 "work in hand has taken so far (0 while it waits for settlements)", registry=r)

    def watch(self, heartbeat, writer_busy_for: Callable[[], float]) -> None:
        """This process's heartbeat (gateway/heartbeat.py) and settlement writer, read at each scrape."""
        for outcome in heartbeat.outcomes:  # (each series from 0: a first failure is an increase)
            self.heartbeats.labels(outcome)
        heartbeat.observers.append(lambda outcome: self.heartbeats.labels(outcome).inc())
        heartbeat.suspension_observers.append(self.suspended.inc)
        self.heartbeat_age.set_function(heartbeat.age)
        self.writer_busy.set_function(writer_busy_for)

    def answered(self, model: str, backend: str, status: str, seconds: float) -> None:
        """One request answered: `requests_total` by status and its whole duration, whatever the
        status (the gateway's own 429s, 502s and 503s and error answers too, as vLLM's and LiteLLM's
        request metrics count failed requests; `backend` is empty where none answered)."""
        self.requests.labels(model, backend, status).inc()
        self.latency.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
