"""Soak test of the default server: mixed load for a long time, then no 5xx, no leaked KV block, flat RSS.

    python benchmarks/soak.py --minutes 30 --clients 16          # the full run (about 32 minutes)
    python benchmarks/soak.py --minutes 2 --warmup-minutes 1 --clients 8

Starts `treeserve serve` (no model named: the bundled arith-gen + arith-prm pair) on a free
loopback port, waits for /health, and runs `--clients` client loops of mixed requests (see
`treeserve.bench.soak_load`) for `--minutes`. Meanwhile it samples the resident memory of the
server process and its children. At the end it waits for the server to go idle, sends one tiny
completion per model (so each engine steps once more and its gauges are current), and reads
/metrics: every model must have no running or waiting request and hold no KV block beyond
`treeserve:kv_blocks_kept` (blocks the PRM scorer keeps on purpose; taken as 0 when the server
does not export it). RSS growth is measured from `--warmup-minutes` to the end of the load, mean of
the first three samples of that window against the mean of its last three.

PASS when no response was a 5xx, no block leaked, the server stayed up, and RSS grew less than
`--max-rss-growth` percent. Writes soak.json, rss.csv and server.log under `--out`.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from statistics import fmean

import httpx

from treeserve.bench.metrics import distribution
from treeserve.bench.overhead import wait_healthy
from treeserve.bench.soak_load import LoadConfig, Outcome, Problem, run_load
from treeserve.bench.sweep import ServerProcess, ServerSpec
from treeserve.bench.telemetry import parse_prometheus
from treeserve.ports import free_port
from treeserve.tasks.arithmetic import random_problem

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_in_use", "kv_blocks_kept")
SMOOTHING_SAMPLES = 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--warmup-minutes", type=float, default=10.0, help="RSS growth is measured after this")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client loops")
    parser.add_argument("--out", default="bench_out/soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--request-timeout", type=float, default=180.0, help="seconds before a request counts "
                        "as timed out")
    parser.add_argument("--max-rss-growth", type=float, default=2.0, help="percent")
    parser.add_argument("--stream-search-400", choices=["expected", "error"], default="error",
                        help="whether a 400 to a streamed search is an expected answer (a server without it)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for `treeserve serve` (repeatable), e.g. --server-arg=--max-num-seqs=64")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.rss_interval <= 0:
        parser.error("--minutes and --rss-interval must be > 0 and --clients >= 1")
    if not 0 <= args.warmup_minutes < args.minutes:
        parser.error(f"--warmup-minutes must be in [0, --minutes), got {args.warmup_minutes}")
    return args


def arithmetic_problems(seed: int, count: int = 256) -> list[Problem]:
    import random

    rng = random.Random(seed)
    rows = (random_problem(rng, level) for level in (rng.choice((1, 2, 3)) for _ in range(count)))
    return [Problem(p.text, p.steps()) for p in rows]


class RssSampler:
    """Resident memory of a process and all its children, every `interval` seconds, on a thread."""

    def __init__(self, pid: int, interval: float, clock_start: float):
        import psutil

        self.process, self.interval, self.clock_start = psutil.Process(pid), interval, clock_start
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def rss(self) -> int | None:
        import psutil

        try:
            family = [self.process, *self.process.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for process in family:
            try:
                total += process.memory_info().rss
            except psutil.Error:  # a child that just exited
                continue
        return total

    def sample(self) -> None:
        rss = self.rss()
        if rss is not None:
            self.samples.append((time.monotonic() - self.clock_start, rss))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "RssSampler":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()


def rss_summary(samples: list[tuple[float, int]], load_seconds: float, warmup_seconds: float) -> dict:
    during = [s for s in samples if s[0] <= load_seconds + 1.0] or [(0.0, None)]
    window = [rss for t, rss in during if t >= warmup_seconds and rss is not None]
    growth = None
    if len(window) >= 2:
        k = min(SMOOTHING_SAMPLES, len(window) // 2)
        growth = 100.0 * (fmean(window[-k:]) - fmean(window[:k])) / fmean(window[:k])
    third = min(during, key=lambda s: abs(s[0] - load_seconds / 3))[1]
    return {"start_bytes": during[0][1], "first_third_bytes": third, "end_bytes": during[-1][1],
            "window_start_s": warmup_seconds, "window_end_s": load_seconds, "window_samples": len(window),
            "growth_percent": growth, "peak_bytes": max((rss for _, rss in samples), default=None)}


def per_model(samples: dict[str, float], gauge: str) -> dict[str, float]:
    """`treeserve:<gauge>{model_name="m"}` -> {m: value}."""
    prefix = f"treeserve:{gauge}{{"
    out = {}
    for series, value in samples.items():
        if series.startswith(prefix) and 'model_name="' in series:
            out[series.split('model_name="', 1)[1].split('"', 1)[0]] = value
    return out


def scrape(client: httpx.Client) -> dict[str, float]:
    response = client.get("/metrics")
    response.raise_for_status()
    return parse_prometheus(response.text)


def busy_models(samples: dict[str, float]) -> list[str]:
    counts = Counter()
    for gauge in ("num_requests_running", "num_requests_waiting"):
        counts.update(per_model(samples, gauge))
    return sorted(m for m, n in counts.items() if n)


def wait_idle(client: httpx.Client, timeout: float) -> tuple[dict[str, float], float]:
    """The metrics once no model runs or waits for a request (or at the timeout), and the wait."""
    start = time.monotonic()
    while True:
        samples = scrape(client)
        if not busy_models(samples) or time.monotonic() - start > timeout:
            return samples, time.monotonic() - start
        time.sleep(0.5)


def refresh_gauges(client: httpx.Client) -> None:
    """One one-token completion per served model: its engine steps, so its gauges are current."""
    for row in client.get("/v1/models").json()["data"]:
        client.post("/v1/completions", json={"model": row["id"], "prompt": "1", "max_tokens": 1})


def kv_check(base_url: str, first_wait: float = 30.0, idle_timeout: float = 120.0) -> dict:
    """Waits for idle, refreshes the gauges, waits again, and compares blocks in use with blocks kept.

    The gauges before the refresh are kept in the report: when they still show running requests
    although every client is done, the server's gauges were stale (not updated by its last steps)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        before, waited = wait_idle(client, first_wait)
        refresh_gauges(client)
        samples, waited_after = wait_idle(client, idle_timeout)
    in_use, kept = per_model(samples, "kv_blocks_in_use"), per_model(samples, "kv_blocks_kept")
    leaked = {m: in_use[m] - kept.get(m, 0.0) for m in in_use}
    return {"idle_wait_s": round(waited, 2), "busy_before_refresh": busy_models(before),
            "gauges_before_refresh": {g: per_model(before, g) for g in GAUGES}, "idle_wait_after_refresh_s": round(waited_after, 2),
            "busy_models": busy_models(samples), "kv_blocks_in_use": in_use, "kv_blocks_kept": kept,
            "kept_metric_present": bool(kept), "leaked_blocks": leaked,
            "metrics": {k: v for k, v in samples.items() if not k.split("{")[0].endswith("_bucket")}}


def finished_on_server(kv: dict, model: str) -> float:
    """Requests of `model` the server counted as finished for any reason but an abort."""
    prefix = "treeserve:request_success_total{"
    return sum(v for k, v in kv.get("metrics", {}).items()
               if k.startswith(prefix) and f'model_name="{model}"' in k and 'finished_reason="abort"' not in k)


def is_unexpected(o: Outcome) -> bool:
    """An answer that came back but was not what a client expects (a wrong status or body)."""
    return bool(o.problem) and o.status not in ("conn_error", "timeout")


def tally(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """kind -> {status: count}; a status marked `!` is an answer that was not the expected one."""
    table: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        table[o.kind][o.status + ("!" if is_unexpected(o) else "")] += 1
    return {kind: dict(sorted(c.items())) for kind, c in sorted(table.items())}


def latencies(outcomes: list[Outcome]) -> dict[str, dict]:
    """Milliseconds per kind: count, median, p99 and max."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o.seconds)
    table = {}
    for kind, seconds in sorted(by_kind.items()):
        stats = distribution(seconds)
        table[kind] = {"count": stats["count"], "median": stats["median"], "p99": stats["p99"],
                       "max": max(seconds) * 1000.0}
    return table


def problems_seen(outcomes: list[Outcome], limit: int = 20) -> list[dict]:
    counts = Counter((o.kind, o.status, o.problem) for o in outcomes if o.problem)
    return [{"kind": k, "status": s, "problem": p, "count": n} for (k, s, p), n in counts.most_common(limit)]


def server_log_errors(path: Path, limit: int = 10) -> tuple[int, list[str]]:
    lines = [line.rstrip() for line in path.read_text(errors="replace").splitlines()
             if "Traceback" in line or " ERROR " in line or "Exception" in line]
    return len(lines), lines[:limit]


def fmt_mib(n) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):,.1f} MiB"


def verdict(report: dict, max_growth: float) -> list[str]:
    """The reasons for FAIL; empty when the run passes."""
    reasons = []
    if report["num_5xx"]:
        reasons.append(f"{report['num_5xx']} responses were 5xx")
    leaked = sum(report["kv"].get("leaked_blocks", {}).values())
    if report["kv"].get("error"):
        reasons.append(f"the KV check failed: {report['kv']['error']}")
    elif leaked:
        reasons.append(f"{leaked:.0f} KV blocks leaked")
    if report["kv"].get("busy_models"):
        reasons.append(f"still busy at the end: {', '.join(report['kv']['busy_models'])}")
    growth = report["rss"]["growth_percent"]
    if growth is None or growth >= max_growth:
        reasons.append(f"RSS growth {growth if growth is None else round(growth, 2)}% is not < {max_growth}%")
    if report["server_exit_code"] is not None:
        reasons.append(f"the server exited early with code {report['server_exit_code']}")
    if not report["loops_stopped_by_themselves"]:
        reasons.append("client loops had to be cut at the hard time limit")
    return reasons


def print_kv(report: dict) -> None:
    kv = report["kv"]
    if "error" in kv:
        print(f"leaked blocks: unknown ({kv['error']})")
        return
    kept_note = "" if kv["kept_metric_present"] else " (no treeserve:kv_blocks_kept gauge: kept taken as 0)"
    print(f"leaked blocks: {sum(kv['leaked_blocks'].values()):.0f} {kv['leaked_blocks']}; in use "
          f"{kv['kv_blocks_in_use']}, kept {kv['kv_blocks_kept']}{kept_note}; idle after {kv['idle_wait_s']} s")
    before = kv["gauges_before_refresh"]
    if kv["busy_before_refresh"] or before["kv_blocks_in_use"] != kv["kv_blocks_in_use"]:
        print(f"stale gauges: with every client done, /metrics showed running {before['num_requests_running']}, "
              f"waiting {before['num_requests_waiting']}, blocks in use {before['kv_blocks_in_use']} until one more "
              f"step of each engine (the gauge refresh)")
    print(f"finished requests: {report['client_finished_generations']} chat/completion answers completed on the "
          f"client side (cut streams not counted), {report['server_finished_generations']:.0f} counted by the "
          f"server's treeserve:request_success_total (arith-gen, reason not abort; one is the gauge refresh)")


def print_report(report: dict, args) -> None:
    print("requests by kind and status (! marks an answer that was not the expected one):")
    for kind, statuses in report["by_kind"].items():
        lat = report["latency_ms"][kind]
        print(f"  {kind:18s} {', '.join(f'{s}: {n}' for s, n in statuses.items()):40s} "
              f"median {lat['median']:8.0f} ms  p99 {lat['p99']:8.0f} ms  max {lat['max']:8.0f} ms")
    print(f"requests: {report['num_requests']} ({report['num_requests'] / report['load_seconds']:.1f}/s)")
    print(f"5xx responses: {report['num_5xx']}")
    print(f"connection errors: {report['num_conn_errors']}; timeouts: {report['num_timeouts']}; "
          f"unexpected answers: {report['num_unexpected']}")
    for row in report["problems"][:8]:
        print(f"  {row['count']:5d} x {row['kind']} [{row['status']}]: {row['problem']}")
    rss = report["rss"]
    print(f"rss: start {fmt_mib(rss['start_bytes'])}, after the first third {fmt_mib(rss['first_third_bytes'])}, "
          f"end {fmt_mib(rss['end_bytes'])}, peak {fmt_mib(rss['peak_bytes'])}")
    window = (args.minutes - args.warmup_minutes)
    growth = "n/a" if rss["growth_percent"] is None else f"{rss['growth_percent']:.2f}%"
    print(f"rss growth over the last {window:g} min (minute {args.warmup_minutes:g} to {args.minutes:g}): {growth}")
    print_kv(report)
    print(f"server log: {report['server_log_errors']} error lines")
    for line in report["server_log_excerpt"][:5]:
        print(f"  {line[:200]}")
    print("PASS" if not report["fail_reasons"] else "FAIL: " + "; ".join(report["fail_reasons"]))


def write_outputs(out: Path, report: dict, samples: list[tuple[float, int]], outcomes: list[Outcome]) -> None:
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    with open(out / "rss.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_seconds", "rss_bytes"])
        writer.writerows((round(t, 3), rss) for t, rss in samples)
    with open(out / "requests.jsonl", "w") as f:
        f.writelines(json.dumps(o.as_json()) + "\n" for o in outcomes)


def build_report(args, outcomes, finished, load_seconds, samples, kv, server) -> dict:
    statuses = Counter(o.status for o in outcomes)
    errors, excerpt = server_log_errors(Path(args.out) / "server.log")
    report = {"config": vars(args), "load_seconds": round(load_seconds, 1), "num_requests": len(outcomes),
              "by_kind": tally(outcomes), "latency_ms": latencies(outcomes),
              "num_5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
              "num_conn_errors": statuses["conn_error"], "num_timeouts": statuses["timeout"],
              "num_unexpected": sum(map(is_unexpected, outcomes)), "problems": problems_seen(outcomes),
              "rss": rss_summary(samples, load_seconds, args.warmup_minutes * 60), "kv": kv,
              "server_exit_code": server.died_with, "loops_stopped_by_themselves": finished,
              "server_log_errors": errors, "server_log_excerpt": excerpt,
              "client_finished_generations": sum(o.status == "200" for o in outcomes
                                                 if o.kind in ("chat", "chat_stream", "completion")),
              "server_finished_generations": finished_on_server(kv, "arith-gen")}
    report["fail_reasons"] = verdict(report, args.max_rss_growth)
    return report


def soak(args, server: ServerProcess, base_url: str) -> tuple[dict, list[tuple[float, int]], list[Outcome]]:
    wait_healthy(base_url, server.process, args.startup_timeout)
    config = LoadConfig(base_url=base_url, stream_search_400_ok=args.stream_search_400 == "expected",
                        request_timeout=args.request_timeout, seed=args.seed)
    problems = arithmetic_problems(args.seed)
    clock_start = time.monotonic()
    sampler = RssSampler(server.process.pid, args.rss_interval, clock_start).start()
    print(f"soak: {args.clients} clients for {args.minutes:g} min against {base_url} (pid {server.process.pid})",
          flush=True)
    try:
        outcomes, finished = asyncio.run(run_load(config, problems, args.clients, args.minutes * 60, clock_start))
        load_seconds = time.monotonic() - clock_start
    finally:
        sampler.stop()
    try:
        kv = kv_check(base_url) if server.process.poll() is None else {"error": "the server is not running"}
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        kv = {"error": f"{type(exc).__name__}: {exc}"}
    if server.process.poll() is not None:
        server.died_with = server.process.returncode
    report = build_report(args, outcomes, finished, load_seconds, sampler.samples, kv, server)
    return report, sampler.samples, outcomes


def raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "treeserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               *args.server_arg]
    signal.signal(signal.SIGTERM, raise_interrupt)
    server = ServerProcess(ServerSpec(name="soak", base_url=base_url, command=command), out / "server.log")
    try:
        report, samples, outcomes = soak(args, server, base_url)
    except KeyboardInterrupt:
        print("soak: interrupted; the server is stopped and no report is written", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as exc:  # the server did not come up
        tail = (out / "server.log").read_text(errors="replace").splitlines()[-15:]
        print(f"soak: {exc}\n" + "\n".join(tail), file=sys.stderr)
        return 2
    finally:
        server.stop()
    write_outputs(out, report, samples, outcomes)
    print_report(report, args)
    print(f"report: {out / 'soak.json'}, {out / 'rss.csv'}, {out / 'requests.jsonl'}, {out / 'server.log'}")
    return 0 if not report["fail_reasons"] else 1


if __name__ == "__main__":
    sys.exit(main())
