"""The gateway's cost: the same load straight to `treeserve serve` and through `treeserve gateway`
(key checked, worst case reserved, usage settled in SQLite, stream relayed), alternately.

Starts the default server (the bundled arith-gen) and a gateway in front of it, each its own
process on this machine, creates a key, then runs `treeserve bench serve`'s load (random prompts,
streamed, fixed output length) at concurrency 32 against each, `--pairs` times, alternating which
goes first. Prints output tok/s and TTFT p50 of every run, the ratio gateway / direct by pair and
its median, and the TTFT the gateway adds (median over pairs).

    python benchmarks/gateway_overhead.py [--pairs 3] [--concurrency 32] [--num-requests 256]
    python benchmarks/gateway_overhead.py --bench-model   # the ~150M random Llama of peers.py instead
    python benchmarks/gateway_overhead.py --floor         # also through a bare byte relay (byte_relay.py)

`--floor` adds a third arm to every pair: the same load through `byte_relay.py`, which pipes bytes
and does nothing else. Its ratio is what a Python hop costs on this machine before any of a
gateway's work; the gateway's own cost is the distance between the two.

The bundled arith-gen is tiny: it streams ~3,000 tokens/s on 2 cores, and every chunk the gateway
relays is CPU the engine does not get on the same machine. The ~150M model streams ~10x fewer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from treeserve.bench.overhead import wait_healthy
from treeserve.bench.run import BenchConfig, run_benchmark
from treeserve.ports import free_port

MASTER = "sk-bench-master"


@contextlib.contextmanager
def process(args: list[str], url: str):
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, timeout=300)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def load(url: str, key: str | None, args, out: Path) -> dict:
    config = BenchConfig(base_url=url, out=str(out), model=args.model, api_key=key, concurrency=[args.concurrency],
                         num_requests=args.num_requests, input_len=[args.input_len], output_len=[args.output_len],
                         warmup=args.concurrency, plots=False)
    level = run_benchmark(config)["levels"][0]
    if level["failed"]:
        raise RuntimeError(f"{url}: {level['failed']} requests failed: {level['errors']}")
    return {"tok_s": level["output_throughput"], "ttft_p50_ms": level["ttft_ms"]["median"]}


def idle_ttft_ms(url: str, key: str | None, model: str, count: int = 50) -> float:
    """Median time to the first streamed chunk of one-token requests sent one at a time: the
    gateway's own latency, with no queue in front of the engine."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "1 + 1 =", "max_tokens": 1, "stream": True}
    times = []
    with httpx.Client(headers=headers, timeout=60) as client:
        for _ in range(count + 5):
            start = time.perf_counter()
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        times.append(time.perf_counter() - start)
                        break
    return statistics.median(times[5:]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--bench-model", action="store_true", help="serve the ~150M random Llama (peers.py's) "
                        "instead of the bundled arith-gen")
    parser.add_argument("--floor", action="store_true", help="also run each pair through byte_relay.py (a bare "
                        "byte pipe): the cost of any Python hop on this machine")
    args = parser.parse_args()
    serve_args = ["serve", "--port"]
    args.model = "arith-gen"
    if args.bench_model:
        from treeserve.bench.offline import benchmark_model_dir

        args.model = "bench-150m"
        serve_args = ["serve", str(benchmark_model_dir()), "--served-model-name", args.model, "--port"]
    work = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    server_port, gateway_port, relay_port = free_port(), free_port(), free_port()
    direct, through = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{gateway_port}"
    relayed = f"http://127.0.0.1:{relay_port}"
    cli = [sys.executable, "-m", "treeserve.cli"]
    relay = [sys.executable, str(Path(__file__).parent / "byte_relay.py"), str(relay_port), str(server_port)]
    with process(cli + serve_args + [str(server_port)], direct), \
            process(cli + ["gateway", "--backend", f"{args.model}={direct}", "--master-key", MASTER,
                           "--database", f"sqlite:///{work / 'gateway.db'}", "--port", str(gateway_port)], through), \
            (process(relay, relayed) if args.floor else contextlib.nullcontext()):
        key = httpx.post(through + "/key/generate", headers={"Authorization": f"Bearer {MASTER}"},
                         json={"key_alias": "bench"}, timeout=30).json()["key"]
        arms = [("direct", direct, None), ("gateway", through, key)] + ([("relay", relayed, None)] if args.floor else [])
        for _, url, api_key in arms:  # first runs are slower: not measured
            load(url, api_key, args, work / "warmup")
        idle = {"direct": idle_ttft_ms(direct, None, args.model), "gateway": idle_ttft_ms(through, key, args.model)}
        print(f"idle TTFT (one request at a time, median of 50): direct {idle['direct']:.2f} ms, "
              f"gateway {idle['gateway']:.2f} ms, added {idle['gateway'] - idle['direct']:+.2f} ms", flush=True)
        runs = []
        for pair in range(args.pairs):
            result = {}
            shift = pair % len(arms)  # each arm takes each place in the order in turn
            for name, url, api_key in arms[shift:] + arms[:shift]:
                result[name] = load(url, api_key, args, work / f"{name}_{pair}")
                print(f"pair {pair + 1} {name}: {result[name]['tok_s']:.1f} output tok/s, "
                      f"TTFT p50 {result[name]['ttft_p50_ms']:.1f} ms", flush=True)
            runs.append(result)
        logs = httpx.get(through + "/spend/logs", params={"limit": 100000},
                         headers={"Authorization": f"Bearer {MASTER}"}, timeout=60).json()
    ratios = [r["gateway"]["tok_s"] / r["direct"]["tok_s"] for r in runs]
    added = [r["gateway"]["ttft_p50_ms"] - r["direct"]["ttft_p50_ms"] for r in runs]
    print(f"throughput gateway / direct by pair: {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.3f})")
    print(f"TTFT p50 added by the gateway by pair: {', '.join(f'{x:+.1f}' for x in added)} ms "
          f"(median {statistics.median(added):+.1f} ms)")
    floor = {}
    if args.floor:
        floor["ratios"] = [r["relay"]["tok_s"] / r["direct"]["tok_s"] for r in runs]
        floor["ttft_added_ms"] = [r["relay"]["ttft_p50_ms"] - r["direct"]["ttft_p50_ms"] for r in runs]
        print(f"floor, a bare byte relay / direct by pair: {', '.join(f'{x:.3f}' for x in floor['ratios'])} "
              f"(median {statistics.median(floor['ratios']):.3f}), TTFT p50 added "
              f"{', '.join(f'{x:+.1f}' for x in floor['ttft_added_ms'])} ms "
              f"(median {statistics.median(floor['ttft_added_ms']):+.1f} ms)")
    print(f"spend logs written: {len(logs)} (every request through the gateway, warm-ups included)")
    print(json.dumps({"runs": runs, "ratios": ratios, "ttft_added_ms": added, "idle_ttft_ms": idle, "floor": floor}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
