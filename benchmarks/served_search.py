"""Served search against the offline SearchRunner, on the same problems and seeds, in one run.

Starts `treeserve serve` with the bundled pair (arith-gen + arith-prm), then for each repeat runs,
alternately, the offline runner (this process, same engine options) and 32 concurrent
`POST /v1/search` (beam, N=16), and prints problems/s for both and `served / offline` (the median of
the back-to-back pairs; each pair searches with seeds of its own, so no repeat reuses an earlier
one's scores); checks that every served answer and chosen completion equals the offline one and
every score matches it within SCORE_TOLERANCE (float32 rounding in another batch composition). Then,
while the searches run again, it measures a chat completion's time to first token against the idle
server (median of 10 each), and reads /metrics before and after to show the searches' engine steps
and tokens counted there.

    python benchmarks/served_search.py [--problems 32] [--n 16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from treeserve import Runtime
from treeserve.bench.overhead import wait_healthy
from treeserve.bench.telemetry import parse_prometheus
from treeserve.search.config import SearchConfig
from treeserve.search.runner import SearchRunner
from treeserve.model.registry import DEFAULT_PAIR
from treeserve.tasks.arithmetic import generate

SEEDS_PER_REPEAT = 1000
# Scores are float32 sums, and a server batches each step with whatever else is in flight: the same
# PRM input in another batch composition rounds differently (CPU GEMM kernels differ by row count),
# by about 3e-7 here. Answers and completions must be identical; scores equal to this tolerance.
SCORE_TOLERANCE = 1e-6
CHAT = {"model": "arith-gen", "messages": [{"role": "user", "content": "Start with 3. Step 1: + 4. What is the result?"}],
        "max_tokens": 8, "stream": True}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--num-iterations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--agg-strategy", default="min", help="arith-prm's declared aggregation")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-samples", type=int, default=10)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", type=Path, default=Path("bench_out/served_search"))
    return parser.parse_args()


def config_for(args, seed: int) -> SearchConfig:
    return SearchConfig(strategy="beam", n=args.n, beam_width=args.beam_width, num_iterations=args.num_iterations,
                        max_tokens=args.max_tokens, agg_strategy=args.agg_strategy, seed=seed)


def body_for(args, question: str, seed: int, stream: bool = False) -> dict:
    return {"model": "arith-gen", "verifier": "arith-prm", "question": question, "strategy": "beam", "n": args.n,
            "beam_width": args.beam_width, "num_iterations": args.num_iterations, "max_tokens": args.max_tokens,
            "agg_strategy": args.agg_strategy, "seed": seed, "stream": stream}


# ---- offline -------------------------------------------------------------------------------
Result = tuple[str | None, float, str]  # (answer, aggregated score, chosen completion)


def offline(rt: Runtime, args, questions: list[str], seed0: int) -> tuple[float, list[Result]]:
    """Every problem as its own submission (index 0, seed = seed0 + its position), as the server
    gets them."""
    runner = SearchRunner(rt.engine("arith-gen"), rt.scorer("arith-prm"))
    start = time.perf_counter()
    handles = [runner.submit(q, config_for(args, seed0 + i)) for i, q in enumerate(questions)]
    rt.loop.run_until(lambda: all(h.done for h in handles))
    seconds = time.perf_counter() - start
    rt.loop.remove_client(runner)
    results = [h.result for h in handles]
    return seconds, [(r.pred, r.agg_scores[r.chosen], r.completions[r.chosen]) for r in results]


# ---- served --------------------------------------------------------------------------------
async def served(url: str, args, questions: list[str], seed0: int) -> tuple[float, list[Result]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post("/v1/search", json=body_for(args, q, seed0 + i))
                                         for i, q in enumerate(questions)))
        seconds = time.perf_counter() - start
    for reply in replies:
        reply.raise_for_status()
    bodies = [r.json() for r in replies]
    return seconds, [(b["answer"], b["score"], b["completion"]) for b in bodies]


def differences(questions: list[str], offline_results: list[Result], served_results: list[Result]) -> list[dict]:
    """Every problem whose served result is not the offline one: another answer or completion, or a
    score further than SCORE_TOLERANCE from the offline one."""
    rows = []
    for question, off, srv in zip(questions, offline_results, served_results):
        if (off[0], off[2]) != (srv[0], srv[2]) or abs(off[1] - srv[1]) > SCORE_TOLERANCE:
            rows.append({"question": question, "offline": off, "served": srv, "same_answer": off[0] == srv[0],
                         "same_completion": off[2] == srv[2], "score_difference": abs(off[1] - srv[1])})
    return rows


async def ttft(client: httpx.AsyncClient) -> float:
    start, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/chat/completions", json=CHAT) as reply:
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("chat stream ended without content")
    return first


async def ttft_under_load(url: str, args, questions: list[str], seed0: int) -> tuple[list[float], list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        idle = [await ttft(client) for _ in range(args.ttft_samples)]
        searches = [asyncio.ensure_future(client.post("/v1/search", json=body_for(args, q, seed0 + i)))
                    for i, q in enumerate(questions)]
        await asyncio.sleep(1.0)  # the searches are under way
        loaded = []
        for _ in range(args.ttft_samples):
            if all(s.done() for s in searches):
                break
            loaded.append(await ttft(client))
        await asyncio.gather(*searches)
    return idle, loaded


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics").text)


def metric_delta(before: dict, after: dict, prefix: str) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if k.startswith(prefix) and after[k] != before.get(k, 0.0)}


def start_server(args) -> subprocess.Popen:
    command = [sys.executable, "-m", "treeserve.cli", "serve", "--port", str(args.port), "--dtype", args.dtype]
    return subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> int:
    args = parse_args()
    questions = [p.text for p in generate("test", args.problems, seed=0)]
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args)
    try:
        rt = Runtime(DEFAULT_PAIR, dtype=args.dtype)
        wait_healthy(url, server, timeout=300)
        print(f"{args.problems} beam searches (N={args.n}, width {args.beam_width}, {args.num_iterations} iterations), "
              f"dtype {args.dtype}, {os.cpu_count()} CPUs")
        offline(rt, args, questions, 0)  # warm-up, untimed: first-use kernel and allocator set-up on both sides
        asyncio.run(served(url, args, questions, 0))
        rows, differing, largest_rounding = [], [], 0.0
        for repeat in range(args.repeats):
            seed0 = SEEDS_PER_REPEAT * (repeat + 1)  # new searches each repeat: no score-cache reuse across them
            off_s, off_results = offline(rt, args, questions, seed0)
            srv_s, srv_results = asyncio.run(served(url, args, questions, seed0))
            diff = differences(questions, off_results, srv_results)
            same = len(questions) - len(diff)
            rounding = max(abs(a[1] - b[1]) for a, b in zip(off_results, srv_results))
            largest_rounding = max(largest_rounding, rounding)
            differing += [d | {"repeat": repeat + 1} for d in diff]
            rows.append({"offline_s": off_s, "served_s": srv_s, "ratio": off_s / srv_s, "same": same})
            print(f"repeat {repeat + 1}: offline {len(questions) / off_s:.3f} problems/s ({off_s:.2f} s), served "
                  f"{len(questions) / srv_s:.3f} problems/s ({srv_s:.2f} s), served / offline {off_s / srv_s:.3f}, "
                  f"equal results {same}/{len(questions)}")
        ratio = statistics.median(r["ratio"] for r in rows)
        print(f"served / offline: {ratio:.3f} (median of {len(rows)} pairs)")
        print(f"served results equal to offline: {'yes' if not differing else f'NO ({len(differing)} differ)'} (same "
              f"answers and chosen completions, scores within {SCORE_TOLERANCE:g}; largest score difference "
              f"{largest_rounding:.1e})")
        for d in differing:
            print(f"  repeat {d['repeat']}: answer {d['offline'][0]} -> {d['served'][0]}, score {d['offline'][1]:.9f} -> "
                  f"{d['served'][1]:.9f}, {'same' if d['same_completion'] else 'another'} completion")
        before = metrics(url)
        idle, loaded = asyncio.run(ttft_under_load(url, args, questions, SEEDS_PER_REPEAT * (args.repeats + 1)))
        after = metrics(url)
        ttft_ratio = statistics.median(loaded) / statistics.median(idle)
        print(f"chat TTFT idle median {statistics.median(idle) * 1e3:.1f} ms, during {args.problems} searches median "
              f"{statistics.median(loaded) * 1e3:.1f} ms ({len(loaded)} samples): {ttft_ratio:.2f}x")
        counted = {k: v for k, v in metric_delta(before, after, "treeserve:").items()
                   if any(word in k for word in ("iteration_tokens_total_count", "generation_tokens", "prompt_tokens",
                                                 "search_problems_finished", "search_verifier_tokens"))}
        print("metrics counted during the loaded run: " + ", ".join(f"{k} +{v:g}" for k, v in sorted(counted.items())))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "served_search.json").write_text(json.dumps(
            {"rows": rows, "ratio": ratio, "mismatches": len(differing), "differing": differing,
             "largest_score_difference": largest_rounding, "ttft_idle": idle, "ttft_loaded": loaded,
             "ttft_ratio": ttft_ratio, "metrics_delta": counted}, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
