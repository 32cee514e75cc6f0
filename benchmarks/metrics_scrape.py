"""What a Prometheus scrape of /metrics costs a serving treeserve server: `treeserve bench serve` at
concurrency 16 with the telemetry thread scraping every 0.2 s, against the same load with no scrape
during the level (--telemetry-interval 1e6: one scrape before and one after, as in every run), on one
server, alternating, and the ratio of output throughputs (scraped / not), median of the pairs.

    .venv/bin/python benchmarks/metrics_scrape.py --pairs 3            # the long-prompt model, 1k x 128
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from treeserve.bench.health import wait_healthy
from treeserve.bench.offline import long_prompt_model_dir
from treeserve.ports import free_port

SCRAPED, UNSCRAPED = 0.2, 1e6


def bench(url: str, out: Path, interval: float, args) -> float:
    """One `treeserve bench serve` run; its output tokens per second."""
    subprocess.run([sys.executable, "-m", "treeserve.cli", "bench", "serve", "--base-url", url, "--out", str(out),
                    "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                    "--warmup", str(args.concurrency), "--telemetry-interval", str(interval), "--no-plots"],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())["levels"][0]["output_throughput"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", type=Path, help="default: the long-prompt benchmark model (168M random Llama)")
    args = parser.parse_args()
    port = free_port()
    model = args.model or long_prompt_model_dir()
    server = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "serve", str(model), "--port", str(port),
                               "--dtype", args.dtype], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout=600)
        ratios = []
        with tempfile.TemporaryDirectory() as root:
            bench(url, Path(root) / "warm-up", UNSCRAPED, args)  # a server's first run is slower: not counted
            for pair in range(args.pairs):
                # alternate which goes first: a drifting machine favours neither
                order = [SCRAPED, UNSCRAPED] if pair % 2 == 0 else [UNSCRAPED, SCRAPED]
                result = {interval: bench(url, Path(root) / f"{pair}-{interval}", interval, args) for interval in order}
                ratios.append(result[SCRAPED] / result[UNSCRAPED])
                print(f"pair {pair + 1}: scraped every 0.2 s {result[SCRAPED]:.1f} out tok/s, unscraped "
                      f"{result[UNSCRAPED]:.1f}: ratio {ratios[-1]:.3f}", flush=True)
        print(f"median ratio scraped / unscraped over {args.pairs} pairs: {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}); {args.input_len} x {args.output_len} tokens, "
              f"concurrency {args.concurrency}, {args.num_requests} requests a run, {model.name}, dtype {args.dtype}")
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
