"""Scoring 16 candidate next steps of one solution prefix: one `POST /v1/score` call against 16
separate `POST /v1/rewards` calls (each the prefix and one candidate, one after another, as a
search framework's PRM client without batching sends them), on `treeserve serve` with the bundled
pair. Every repeat scores fresh problems in both arms (no score-cache hit), the arms alternate,
and the ratio printed is the median of the back-to-back pairs. Scores of both arms must agree.

    python benchmarks/score_candidates.py [--candidates 16] [--repeats 5] [--dtype auto]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx

from treeserve.bench.overhead import wait_healthy
from treeserve.tasks.arithmetic import generate

TOLERANCE = 1e-5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--prefix-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--port", type=int, default=8767)
    return parser.parse_args()


def problem(seed: int, args) -> tuple[str, list[str], list[str]]:
    """A question, the first steps of its reference solution, and candidate next steps (the right
    one and variants of it with other results)."""
    item = generate("test", 1, seed=seed)[0]
    steps = [s for s in item.solution.split("\n\n") if s.strip()]
    prefix, right = steps[:args.prefix_steps], steps[min(args.prefix_steps, len(steps) - 1)]
    return item.text, prefix, [f"{right} ({i})" if i else right for i in range(args.candidates)]


def one_call(client: httpx.Client, question: str, prefix: list[str], candidates: list[str]) -> list[float]:
    body = client.post("/v1/score", json={"model": "arith-prm", "question": question, "steps": prefix,
                                          "candidates": candidates}).raise_for_status().json()
    return [entry["score"] for entry in body["data"]]


def separate_calls(client: httpx.Client, question: str, prefix: list[str], candidates: list[str]) -> list[float]:
    return [client.post("/v1/rewards", json={"model": "arith-prm", "question": question,
                                             "steps": prefix + [c]}).raise_for_status().json()["scores"][-1]
            for c in candidates]


def timed(arm, client, case) -> tuple[float, list[float]]:
    started = time.perf_counter()
    scores = arm(client, *case)
    return time.perf_counter() - started, scores


def main() -> int:
    args = parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "serve", "--port", str(args.port),
                               "--dtype", args.dtype], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, timeout=300)
        with httpx.Client(base_url=url, timeout=300) as client:
            timed(one_call, client, problem(10_000, args))  # warm-up, untimed
            timed(separate_calls, client, problem(10_001, args))
            ratios, ones, separates = [], [], []
            for repeat in range(args.repeats):
                first, second = problem(2 * repeat, args), problem(2 * repeat + 1, args)
                arms = [(one_call, first), (separate_calls, second)] if repeat % 2 == 0 else \
                    [(separate_calls, second), (one_call, first)]
                results = {arm.__name__: timed(arm, client, case) for arm, case in arms}
                (one, one_scores), (separate, _) = results["one_call"], results["separate_calls"]
                check = separate_calls(client, *first)  # (cached now: the same scores, read back)
                worst = max(abs(a - b) for a, b in zip(one_scores, check))
                assert worst <= TOLERANCE, f"scores differ by {worst}"
                ones.append(one)
                separates.append(separate)
                ratios.append(separate / one)
                print(f"repeat {repeat}: one /v1/score call {one * 1000:.1f} ms, {args.candidates} /v1/rewards calls "
                      f"{separate * 1000:.1f} ms, {separate / one:.2f}x")
        print(f"{args.candidates} candidates after {args.prefix_steps} prefix steps, dtype {args.dtype}, "
              f"{os.cpu_count()} CPUs: one call {statistics.median(ones) * 1000:.1f} ms, separate calls "
              f"{statistics.median(separates) * 1000:.1f} ms (medians); one call is "
              f"{statistics.median(ratios):.2f}x faster (median of {args.repeats} alternating pairs)")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
