"""The founding study's experiment on one GPU, as `benchmarks/gpu.py`'s `founding_search` section.

A Llama-3.2-1B-shaped generator and a Llama-3.1-8B-shaped PRM (random weights made on the device,
the word-level tokenizer of gpu_models, so every step keeps its fixed length) run beam search
(N=16, beam width 4, fixed 64-token steps) over questions whose lengths follow MATH-500's, once
per static generator/PRM split of a KV budget and in the shared arena, which hands pages to
whichever model needs them. Every configuration runs `repeats` times, alternated (a new seeded
order each repeat), after an untimed warm-up of every kind of configuration (Triton compiles its
kernels per cache block size, which differs between them); CUDA graphs are captured when each
Runtime is built, before its timing starts. Per configuration: problems/s (median, and the
ratio to the best static split per repeat), tokens computed per model, prefix-cache hit rates,
evictions, thrash and preemptions, and the KV pages in use per model over the run.

The KV budget binds as in the study (`kv_budget_gib`): the study's block arithmetic (KV pages =
KV bytes / (block size x bytes per token)) applied to this workload's demand. At iteration d a
problem holds its question (~q tokens), the histories of its 4 beams (4 x 64 d) and its 16
candidates' new steps (16 x 64): ~q + 256 d + 1,024 tokens in each model, at 32 KiB a token in
the 1B generator and 128 KiB in the 8B PRM. 16 problems at the last of 10 iterations hold
~3.7k tokens each: ~1.9 GB of generator KV and ~7.6 GB of PRM KV, 9.5 GB together. A budget of
5 GiB is about half of that: at the low generator fractions the generator runs short (it queues
and preempts), at the high ones the PRM does (it evicts its cached prefixes and recomputes them),
and no split holds everything, as in the study (where the PRM ran short at one end of the sweep).
"""
from __future__ import annotations

import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from treeserve import Runtime
from treeserve.search.config import SearchConfig
from treeserve.search.runner import SearchRunner

import gpu_models as gm

# MATH-500's problem lengths in characters, at every tenth of the sorted list (0%, 10%, ... 100%),
# read from ../shared/data/math500.jsonl; LaTeX-heavy text is about 3.5 characters a Llama-3 token.
MATH500_CHAR_DECILES = (20, 58, 78, 104, 125, 148, 177, 212, 267, 385, 1733)
CHARS_PER_TOKEN = 3.5
SYSTEM_PROMPT_TOKENS = 70  # Search-and-Learn's system prompt and the chat template, in Llama-3 tokens
SPLITS = (0.08, 0.1, 0.2, 0.3, 0.4, 0.5)  # the generator's fraction of the KV budget (the study's sweep)
MAX_IN_FLIGHT = 16  # problems searched at once (continuous problem batching)


def question_lengths(count: int, seed: int) -> list[int]:
    """Token counts of `count` prompts: a MATH-500 problem's length (drawn uniformly between two
    adjacent deciles) plus the system prompt."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(count):
        i = rng.randrange(len(MATH500_CHAR_DECILES) - 1)
        chars = rng.uniform(MATH500_CHAR_DECILES[i], MATH500_CHAR_DECILES[i + 1])
        lengths.append(SYSTEM_PROMPT_TOKENS + round(chars / CHARS_PER_TOKEN))
    return lengths


def questions(count: int, vocab_size: int, seed: int, smoke: bool) -> list[str]:
    lengths = [8 + n % 16 for n in range(count)] if smoke else question_lengths(count, seed)
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for words in lengths:
        ids = torch.randint(len(gm.SPECIAL) + 2, vocab_size, (words,), generator=generator)
        texts.append(" ".join(f"w{i}" for i in ids.tolist()) + " ?")
    return texts


def configurations(splits, block_size: int) -> list[tuple[str, str, dict]]:
    """(label, kind, Runtime options): the static splits, the shared arena, and the shared arena
    with pages of `block_size` generator tokens (the default page holds 16 generator tokens, so
    the 4x larger PRM gets 4 a page; with 64 it gets 16, as in its static share)."""
    configs = [(f"static gen={f:g}", "static", {"kv_mode": "static", "kv_fractions": {"gen": f, "prm": round(1 - f, 4)}})
               for f in splits]
    configs.append(("shared", "shared", {"kv_mode": "shared"}))
    if block_size:
        configs.append((f"shared, {block_size}-token pages", f"shared{block_size}",
                        {"kv_mode": "shared", "block_size": block_size}))
    return configs


def build_runtime(args, paths: dict[str, Path], trace: Path | None, options: dict) -> Runtime:
    return Runtime({name: str(path) for name, path in paths.items()}, dtype=args.dtype, device=args.device,
                   load_format="dummy", max_model_len=args.founding_max_len, max_num_batched_tokens=8192,
                   max_num_seqs=16 * MAX_IN_FLIGHT, kv_cache_memory_bytes=int(args.founding_kv_gib * (1 << 30)),
                   trace_path=trace, **options)


def search_config(args, depth: int) -> SearchConfig:
    return SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=depth, max_tokens=args.step_tokens,
                        system_prompt=None, seed=0)


def run_one(args, paths, label: str, options: dict, problems: list[str], depth: int) -> dict:
    """One timed search in a fresh Runtime; the Runtime is built (and its graphs captured) first."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        build_start = time.perf_counter()
        rt, runner = build_runtime(args, paths, trace, options), None
        try:
            built = time.perf_counter() - build_start
            runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"), max_problems_in_flight=MAX_IN_FLIGHT)
            gc.collect()
            _synchronize(args.device)
            start = time.perf_counter()
            runner.run(problems, search_config(args, depth))
            _synchronize(args.device)
            seconds = time.perf_counter() - start
            stats = {name: engine.stats() for name, engine in rt.engines.items()}
            blocks = {name: engine.stats().kv_blocks_total for name, engine in rt.engines.items()}
            block_sizes = {name: s.block_size for name, s in stats.items()}
        finally:
            rt.close()
        series, steps = read_trace(trace)
    del rt, runner
    gm.free_memory(args.device)
    row = {"label": label, "seconds": seconds, "build_seconds": built, "problems_s": len(problems) / seconds,
           "tokens_computed": {n: s.num_tokens_computed for n, s in stats.items()},
           "hit_rate": {n: round(s.prefix_hits / s.prefix_queries, 4) if s.prefix_queries else 0.0
                        for n, s in stats.items()},
           "evictions": {n: s.evictions for n, s in stats.items()}, "thrash": {n: s.thrash for n, s in stats.items()},
           "preemptions": {n: s.num_preemptions for n, s in stats.items()},
           "kv_blocks": blocks, "block_size": block_sizes, "steps": steps, "blocks_in_use": series}
    print(f"  {label}: {row['problems_s']:.3f} problems/s ({seconds:.1f} s, built in {built:.1f} s), tokens "
          f"{row['tokens_computed']}, hits {row['hit_rate']}, thrash {row['thrash']}, "
          f"preemptions {row['preemptions']}, steps {steps}", flush=True)
    return row


def read_trace(trace: Path, points: int = 200) -> tuple[dict, dict]:
    """From the per-step telemetry, per model: (seconds, pages in use) at most `points` times, and
    its steps and the seconds they took (each record's time since the one before it)."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line] if trace.is_file() else []
    series: dict[str, list[list[float]]] = {}
    steps: dict[str, dict] = {}
    last = 0.0
    for row in rows:
        series.setdefault(row["model"], []).append([row["t"], row["blocks_in_use"]])
        model = steps.setdefault(row["model"], {"steps": 0, "seconds": 0.0})
        model["steps"] += 1
        model["seconds"] += row["t"] - last
        last = row["t"]
    return {model: values[::max(1, len(values) // points)] for model, values in series.items()}, steps


def _synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_founding_study(args, paths: dict[str, Path], vocab: int, write) -> dict:
    """Warm-up, then `args.founding_repeats` alternated rounds of every configuration (after the
    first round, no run starts once `args.founding_seconds` have passed); `write(result)` after
    every run."""
    problems = questions(args.search_problems, vocab, seed=1, smoke=args.smoke)
    configs = configurations(args.splits, args.founding_block_size)
    result: dict = {"kv_budget_gib": args.founding_kv_gib, "problems": len(problems), "depth": args.search_depth,
                    "step_tokens": args.step_tokens, "question_tokens": [len(q.split()) for q in problems],
                    "warm_up": {}, "runs": {label: [] for label, _, _ in configs}}
    started = time.perf_counter()
    for label, kind, options in {kind: (label, kind, options) for label, kind, options in configs}.values():
        row = run_one(args, paths, f"warm-up ({label})", options, problems[:2], min(2, args.search_depth))
        result["warm_up"][kind] = row["seconds"] + row["build_seconds"]
    for repeat in range(args.founding_repeats):
        print(f"round {repeat + 1}/{args.founding_repeats}", flush=True)
        for label, _, options in random.Random(repeat).sample(configs, len(configs)):
            if repeat and time.perf_counter() - started > args.founding_seconds:
                result["cut"] = f"round {repeat + 1} cut before {label}: past {args.founding_seconds} s"
                print(result["cut"], flush=True)
                return result
            try:
                result["runs"][label].append(run_one(args, paths, label, options, problems, args.search_depth))
            except Exception as exc:  # a split too small for the workload: say so, go on
                result["runs"][label].append({"label": label, "error": f"{type(exc).__name__}: {exc}"})
                print(f"  {label}: {result['runs'][label][-1]['error']}", flush=True)
                gm.free_memory(args.device)
            result["summary"] = summarize(result["runs"])
            write(result)
    return result


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Median problems/s per configuration, the best static split, and shared against it (ratio of
    medians, and the median of the per-round ratios)."""
    medians = {}
    for label, rows in runs.items():
        rates = sorted(r["problems_s"] for r in rows if "problems_s" in r)
        if rates:
            medians[label] = rates[len(rates) // 2]
    static = {label: rate for label, rate in medians.items() if label.startswith("static")}
    summary: dict = {"median_problems_s": medians}
    if not static:
        return summary
    best = max(static, key=static.__getitem__)
    summary["best_static"] = best
    for label in (label for label in medians if label.startswith("shared")):
        pairs = [s["problems_s"] / b["problems_s"] for s, b in zip(runs[label], runs[best])
                 if "problems_s" in s and "problems_s" in b]
        summary[f"{label} / best static"] = medians[label] / static[best]
        summary[f"{label} / best static, per round"] = sorted(pairs)
    return summary


def table_rows(result: dict) -> list[list[str]]:
    summary = result.get("summary", {})
    best = summary.get("best_static")
    rows = []
    for label, rate in summary.get("median_problems_s", {}).items():
        ratio = summary.get(f"{label} / best static")
        rows.append([f"1B+8B beam N=16 ({label})", f"{rate:.3f} problems/s",
                     f"{summary['median_problems_s'][best]:.3f} ({best})" if ratio else "",
                     f"{ratio:.2f}x" if ratio else "", ">= 1.1x best static" if ratio else ""])
    return rows
