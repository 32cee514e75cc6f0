"""The whole stack under mixed load while parts of it die and come back (issue #40), on loopback.

    python benchmarks/chaos.py [--minutes 10] [--clients 16] [--out runs/chaos]

Starts a throwaway PostgreSQL cluster and RabbitMQ node, two `treeserve serve` replicas (the
bundled arith-gen and arith-prm) behind the gateway over HTTP (model `arith-gen`), two `treeserve
worker`s behind it over RabbitMQ (model `arith-gen-mq`), and the gateway on PostgreSQL. Clients
send chats (whole, streamed, and streams they cut after a few events), completions and searches,
on keys with no budget and on one whose budget runs out during the run, while a schedule kills and
restarts a replica, a worker, RabbitMQ and the gateway itself, with SIGKILL and with SIGTERM.

At the end it prints what was sent, answered and refused by kind, and checks:
- every non-streamed request got an answer or an error it can read (an HTTP status with an OpenAI
  error body); none went unanswered but while the gateway itself was down (connection refused or
  reset: the client knows it failed), and none was billed twice;
- every stream ended with [DONE] or an error event, was cut by its client, or broke while the
  gateway itself was killed;
- the spend logs hold what each client received (a stream cut by its client: at least what it
  saw; one cut by a backend's death: what it saw); requests in flight in a gateway killed with
  SIGKILL, or answered in the second before, have no row (that process could not write it, or had
  not committed it yet; their reservations are swept);
- no 5xx but the documented 502 (a stream cut) and 503 (no backend up, or a draining gateway);
- the tight key spent no more than its budget plus one request's worst case (the gateway admits a
  request while spend + reservations are under the budget: docs/GATEWAY.md), and no process is left
  at the end.
Writes `requests.jsonl`, `events.json` and `summary.json` to --out; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
import yaml

from treeserve.bench.services import PostgresCluster, RabbitNode, free_port
from treeserve.bench.sse_data import asse_data
from treeserve.gateway import pricing
from treeserve.gateway.config import ModelConfig
from treeserve.gateway.store import Store

MASTER = "sk-chaos-master"
QUESTIONS = [f"Start with {a} and work modulo 100. Step 1: + {b}. Step 2: * {c}. What is the result?"
             for a, b, c in ((5, 7, 3), (12, 9, 4), (40, 15, 2), (33, 8, 6), (71, 4, 9))]
KINDS = ("chat", "chat_stream", "chat_stream_cut", "completion", "search")
MODELS = ("arith-gen", "arith-gen-mq")  # over HTTP replicas, over RabbitMQ workers
# (fraction of the run, what, how): each component killed and started again
SCHEDULE = [(0.08, "replica0", signal.SIGKILL), (0.18, "worker0", signal.SIGTERM), (0.28, "rabbitmq", signal.SIGKILL),
            (0.40, "gateway", signal.SIGTERM), (0.50, "replica1", signal.SIGTERM), (0.60, "worker1", signal.SIGKILL),
            (0.70, "gateway", signal.SIGKILL), (0.80, "rabbitmq", signal.SIGTERM), (0.88, "replica0", signal.SIGTERM)]
SETTLED_WITHIN_S = 1.0  # an answer's spend row is committed within this (gateway/settlement.py: every 50 ms)
DOWN_S = 3.0  # how long a killed component stays down before it is started again
RETRY_AFTER_S = 1.0  # a refused client waits this long before its next request (the gateway's Retry-After)
TREESERVE = [sys.executable, "-m", "treeserve.cli"]
PRICES = {"input_cost_per_token": 1e-6, "output_cost_per_token": 1e-5, "max_tokens": 64}
SEARCH = {"strategy": "beam", "n": 4, "num_iterations": 4, "max_tokens": 48}  # the searches the clients send


@dataclass
class Result:
    kind: str
    model: str
    key: str
    began: float
    seconds: float = 0.0
    status: int | str = ""          # the HTTP status, or conn_error / timeout
    code: str | None = None         # the error body's code
    request_id: str | None = None
    usage: dict | None = None       # the last usage the client received
    ended: str = ""                 # done, error_event, client_cut, broken, whole


class Stack:
    """The processes of the run, each started again after a kill on the same port and files."""

    def __init__(self, root: Path):
        self.root, self.procs, self.commands = root, {}, {}
        self.postgres = PostgresCluster(root / "postgres")
        (root / "rabbitmq").mkdir()
        self.rabbit = RabbitNode(root / "rabbitmq")
        self.ports = {name: free_port() for name in ("replica0", "replica1", "gateway")}
        self.gateway_url = f"http://127.0.0.1:{self.ports['gateway']}"

    def start(self) -> None:
        self.postgres.start()
        self.database = self.postgres.new_database()
        self.rabbit.start()
        for i in range(2):
            self.commands[f"replica{i}"] = [*TREESERVE, "serve", "--port", str(self.ports[f"replica{i}"]),
                                            "--shutdown-timeout", "20"]
            self.commands[f"worker{i}"] = [*TREESERVE, "worker", "--broker", self.rabbit.url, "--shutdown-timeout", "20"]
        config = self.root / "gateway.yaml"
        replicas = [f"http://127.0.0.1:{self.ports[f'replica{i}']}" for i in range(2)]
        prices = PRICES
        config.write_text(yaml.safe_dump({
            "master_key": MASTER, "database": self.database, "health_interval": 1, "retries": 2,
            "models": {"arith-gen": {"backends": replicas, **prices}, "arith-prm": {"backends": replicas},
                       "arith-gen-mq": {"backends": [{"url": self.rabbit.url, "model": "arith-gen", "timeout": 60}],
                                        **prices}}}))
        self.commands["gateway"] = [*TREESERVE, "gateway", "--config", str(config), "--port", str(self.ports["gateway"]),
                                    "--shutdown-timeout", "20"]
        for name in self.commands:
            self.launch(name)
        for name in self.commands:
            self.wait_up(name)

    def launch(self, name: str) -> None:
        log = open(self.root / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(self.commands[name], stdout=log, stderr=subprocess.STDOUT)

    def wait_up(self, name: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.up(name):
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {(self.root / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def up(self, name: str) -> bool:
        if name.startswith("worker"):
            return "consuming" in (self.root / f"{name}.log").read_text()[-20000:]
        port = self.ports[name]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, name: str, sig: int) -> float:
        """Sends `sig`, waits for the end; returns the seconds that took."""
        began = time.monotonic()
        if name == "rabbitmq":
            self.rabbit.stop(sig)
        else:
            self.procs[name].send_signal(sig)
            self.procs[name].wait(60)
        return time.monotonic() - began

    def restart(self, name: str) -> None:
        if name == "rabbitmq":
            self.rabbit.start()
            return
        with open(self.root / f"{name}.log", "ab") as log:
            log.write(b"\n---- restarted ----\n")
        self.launch(name)
        self.wait_up(name)

    def stop(self) -> None:
        """Everything but PostgreSQL (the spend logs are read after the gateway's drain)."""
        for name in ("gateway", "worker0", "worker1", "replica0", "replica1"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.rabbit.stop()


async def chaos_schedule(stack: Stack, seconds: float, t0: float, events: list[dict]) -> None:
    for fraction, name, sig in SCHEDULE:
        await asyncio.sleep(max(0.0, t0 + fraction * seconds - time.monotonic()))
        began = time.monotonic() - t0
        took = await asyncio.to_thread(stack.kill, name, sig)
        await asyncio.sleep(DOWN_S)
        await asyncio.to_thread(stack.restart, name)
        events.append({"what": name, "signal": signal.Signals(sig).name, "at": round(began, 1),
                       "stopped_in": round(took, 1), "back_at": round(time.monotonic() - t0, 1)})
        print(f"[{began:6.1f} s] {name} {signal.Signals(sig).name}: down {took:.1f} s, back at "
              f"{time.monotonic() - t0:.1f} s", flush=True)


class Client:
    def __init__(self, url: str, keys: dict[str, str], rng: random.Random, results: list[Result], t0: float):
        self.url, self.keys, self.rng, self.results, self.t0 = url, keys, rng, results, t0

    async def loop(self, until: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(120, connect=5)) as http:
            while time.monotonic() < until:
                kind, model = self.rng.choice(KINDS), self.rng.choice(MODELS)
                key = self.rng.choice(list(self.keys))
                result = Result(kind, model, key, time.monotonic() - self.t0)
                try:
                    await getattr(self, kind.removesuffix("_cut"))(http, result, self.keys[key], kind.endswith("_cut"))
                except httpx.TimeoutException:
                    result.status = "timeout"
                except httpx.TransportError:
                    result.status = result.status or "conn_error"
                    result.ended = result.ended or "broken"
                result.seconds = time.monotonic() - self.t0 - result.began
                self.results.append(result)
                if result.status in (429, 503, "conn_error", "timeout"):
                    await asyncio.sleep(RETRY_AFTER_S)  # as a client honouring Retry-After would

    def _headers(self, key: str) -> dict:
        return {"Authorization": f"Bearer {key}"}

    def _question(self) -> str:
        return self.rng.choice(QUESTIONS)

    async def _whole(self, http, path: str, body: dict, result: Result, key: str) -> None:
        response = await http.post(path, json=body, headers=self._headers(key))
        result.status, result.request_id = response.status_code, response.headers.get("x-request-id")
        payload = response.json()
        if response.status_code == 200:
            result.usage, result.ended = payload.get("usage"), "whole"
        else:
            result.code, result.ended = (payload.get("error") or {}).get("code") or "no_code", "error"

    async def chat(self, http, result: Result, key: str, cut: bool) -> None:
        body = {"model": result.model, "messages": [{"role": "user", "content": self._question()}],
                "max_tokens": self.rng.randint(8, 48), "temperature": 0.8}
        await self._whole(http, "/v1/chat/completions", body, result, key)

    async def completion(self, http, result: Result, key: str, cut: bool) -> None:
        body = {"model": result.model, "prompt": self._question(), "max_tokens": self.rng.randint(8, 48)}
        await self._whole(http, "/v1/completions", body, result, key)

    async def search(self, http, result: Result, key: str, cut: bool) -> None:
        body = {"model": result.model, "verifier": "arith-prm", "question": self._question(), **SEARCH,
                "seed": self.rng.randrange(1 << 20)}
        await self._whole(http, "/v1/search", body, result, key)

    async def chat_stream(self, http, result: Result, key: str, cut: bool) -> None:
        body = {"model": result.model, "messages": [{"role": "user", "content": self._question()}],
                "max_tokens": self.rng.randint(16, 64), "min_tokens": 16, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        stop_after = self.rng.randint(2, 6) if cut else None
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=self._headers(key)) as response:
            result.status, result.request_id = response.status_code, response.headers.get("x-request-id")
            if response.status_code != 200:
                payload = json.loads(await response.aread())
                result.code, result.ended = (payload.get("error") or {}).get("code") or "no_code", "error"
                return
            events = 0
            result.ended = "broken"
            async for data in asse_data(response.aiter_text()):
                if data == "[DONE]":
                    result.ended = result.ended if result.ended == "error_event" else "done"
                    break
                event = json.loads(data)
                if "error" in event:
                    result.ended, result.code = "error_event", event["error"].get("code")
                    continue
                result.usage = event.get("usage") or result.usage
                events += 1
                if stop_after is not None and events >= stop_after:
                    result.ended = "client_cut"
                    break


def make_keys(url: str) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {MASTER}"}
    keys = {}
    for name, budget in (("open-a", None), ("open-b", None), ("tight", 0.05)):
        body = {"key_alias": name} | ({"max_budget": budget} if budget is not None else {})
        response = httpx.post(url + "/key/generate", json=body, headers=headers, timeout=30)
        response.raise_for_status()
        keys[name] = response.json()["key"]
    return keys


def gateway_down(result: Result, events: list[dict]) -> bool:
    """The request was in flight, or sent, while the gateway itself was stopped or starting."""
    end = result.began + result.seconds
    return any(e["what"] == "gateway" and result.began <= e["back_at"] and end >= e["at"] for e in events)


def check(results: list[Result], rows: dict[str, dict], events: list[dict], sigkilled_gateway: list[dict]) -> dict:
    problems = collections.Counter()
    examples: dict[str, dict] = {}

    def problem(name: str, result: Result) -> None:
        problems[name] += 1
        examples.setdefault(name, asdict(result))
    for r in results:
        if isinstance(r.status, int) and r.status >= 500 and r.status not in (502, 503):
            problem(f"http_{r.status}", r)
        if r.status in ("conn_error", "timeout") and not gateway_down(r, events):
            problem(f"{r.status}_while_the_gateway_was_up", r)
        if isinstance(r.status, int) and r.status != 200 and r.code is None:
            problem("error_without_code", r)
        if r.kind.startswith("chat_stream") and r.status == 200 and r.ended == "broken" and not gateway_down(r, events):
            problem("stream_broke_without_an_end_event", r)
        _check_bill(r, rows, sigkilled_gateway, problem)
    return {"problems": dict(problems), "examples": examples}


def _check_bill(r: Result, rows: dict[str, dict], sigkilled_gateway: list[dict], problem) -> None:
    if r.request_id is None or r.status != 200:
        return
    row = rows.get(r.request_id)
    # (a gateway commits settlements every 50 ms: one answered just before its SIGKILL may have no row)
    killed = any(r.began <= e["back_at"] and r.began + r.seconds >= e["at"] - SETTLED_WITHIN_S
                 for e in sigkilled_gateway)
    if row is None:
        if not killed:
            problem("answered_but_not_billed", r)
        return
    got = (r.usage or {}).get("completion_tokens", 0)
    billed = row["completion_tokens"]
    if r.ended in ("whole", "done") and (row["status"] != "success" or billed != got):
        problem("bill_differs_from_the_answer", r)
    elif r.ended == "client_cut" and billed < got:
        problem("cut_stream_billed_less_than_it_got", r)
    elif r.ended == "error_event" and billed != got:
        problem("broken_stream_billed_other_than_it_got", r)


def largest_worst_cost() -> float:
    """The dearest request the clients send, as the gateway reserves it: a search."""
    model = ModelConfig("arith-gen", [], **PRICES)
    body = {"model": "arith-gen", "verifier": "arith-prm", "question": max(QUESTIONS, key=len), **SEARCH, "seed": 0}
    return pricing.worst_cost(body, model, search=True)


def summarise(results: list[Result]) -> dict:
    table = collections.defaultdict(collections.Counter)
    for r in results:
        outcome = "answered" if r.status == 200 and r.ended in ("whole", "done") else (
            f"stream {r.ended}" if r.status == 200 else f"refused {r.status} {r.code or ''}".strip())
        table[f"{r.kind} {r.model}"][outcome] += 1
    return {kind: dict(counts) for kind, counts in sorted(table.items())}


def leftovers() -> list[str]:
    """This script's descendants still running (the stack stopped; PostgreSQL's server is not one)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(proc.cmdline()[:4]))
        except psutil.NoSuchProcess:
            pass
    return alive


async def run_load(stack: Stack, args, keys: dict[str, str]) -> tuple[list[Result], list[dict]]:
    results: list[Result] = []
    events: list[dict] = []
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    rng = random.Random(args.seed)
    clients = [Client(stack.gateway_url, keys, random.Random(rng.random()), results, t0) for _ in range(args.clients)]
    chaos = asyncio.create_task(chaos_schedule(stack, args.minutes * 60, t0, events))
    await asyncio.gather(*(c.loop(until) for c in clients))
    await chaos
    return results, events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="treeserve-chaos-"))
    root.chmod(0o755)  # PostgreSQL runs as its own user, below this directory
    stack = Stack(root)
    try:
        stack.start()
        keys = make_keys(stack.gateway_url)
        print(f"stack up in {root}; load for {args.minutes:g} min with {args.clients} clients", flush=True)
        results, events = asyncio.run(run_load(stack, args, keys))
        key_info = httpx.get(stack.gateway_url + "/key/info", params={"key": keys["tight"]},
                             headers={"Authorization": f"Bearer {MASTER}"}, timeout=30).json()["info"]
    finally:
        stack.stop()
        time.sleep(2)
        left = leftovers()
    try:
        rows = {row["request_id"]: row for row in Store(stack.database).ledger.spend_logs(limit=1_000_000)}
    finally:
        stack.postgres.stop()
    sigkilled = [e for e in events if e["what"] == "gateway" and e["signal"] == "SIGKILL"]
    verdict = check(results, rows, events, sigkilled)
    if key_info["spend"] > key_info["max_budget"] + largest_worst_cost() + 1e-9:
        verdict["problems"]["tight_key_overspent"] = 1
    if left:
        verdict["problems"]["left_behind"] = len(left)
    summary = {"requests": len(results), "by_kind": summarise(results), "events": events, **verdict,
               "tight_key": {"spend": key_info["spend"], "max_budget": key_info["max_budget"],
                             "allowed_above": largest_worst_cost()},
               "spend_rows": len(rows), "left_behind": left}
    (args.out / "requests.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
    (args.out / "events.json").write_text(json.dumps(events, indent=2))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("requests", "by_kind", "problems", "tight_key", "spend_rows",
                                             "left_behind")}, indent=2))
    shutil.rmtree(root, ignore_errors=True)
    return 1 if verdict["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
