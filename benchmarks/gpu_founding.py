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

The KV budget binds as in the study (`--founding-kv-gib`, 4 GiB): the study's block arithmetic (KV
pages = KV bytes / (block size x bytes per token)) applied to this workload's demand. At iteration
d a problem holds its question (~130 tokens on average), the histories of its 4 beams (4 x 64 d)
and its 16 candidates' new steps (16 x 64): ~130 + 256 d + 1,024 tokens in each model, at 32 KiB
a token in the 1B generator and 128 KiB in the 8B PRM. 16 problems at the last of 6 iterations
hold ~2.7k tokens each: ~1.4 GB of generator KV and ~5.6 GB of PRM KV, 7 GB together. 4 GiB is
about 60% of that: at the low generator fractions the generator runs short (it preempts and
recomputes), at the high ones the PRM does (it evicts its cached prefixes and recomputes them),
and no split holds everything, as in the study (where the PRM ran short at one end of the sweep).
Measured on an H200 (docs/BENCHMARKS.md): gen=0.1 preempted 854 times, gen=0.5 thrashed 1,989
PRM blocks.

The models are loaded once; each configuration's Runtime is built over them once (its KV space,
engines and CUDA graphs) and its caches are reset before every run, so the call fits in minutes.

`unconstrained` runs the same search with `ceiling_scale` x the budget (3x: more than the ~7 GB the
search asks for at its deepest, so nothing is evicted or preempted), split as the static splits are
(16-token pages for either model, gen=0.3): what the splits' page geometry reaches when memory never
binds, the ceiling of any policy that hands those pages around (the shared arena's own 4-token PRM
pages hit more finely and run slower: its rows are read beside this one). Each run records whose
allocations evicted the pages that a model asked for again (`thrash_by_evictor`: in the shared
arena, its own or the other model's).

`--founding-replica` (gpu.py) runs this workload on a CPU at the device run's page counts: tiny
models whose KV bytes per token keep the 1B:8B ratio (`REPLICA_SHAPES`, 1:4) in a budget scaled by
the generator's bytes per token against the 1B's in bfloat16 (`replica_kv_scale`), so every page,
hit, eviction and preemption follows the device's arithmetic (the models' random weights differ, so
the counts come close to the device's, not equal; docs/BENCHMARKS.md); only the times are the CPU's.
"""
from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path

import torch

from treeserve import Runtime
from treeserve.engine import kv_arena
from treeserve.lifecycle import freeze_startup_heap
from treeserve.model.hf_config import parse_model_config
from treeserve.search.config import SearchConfig
from treeserve.search.runner import SearchRunner

import gpu_founding_profile
import gpu_models as gm

# MATH-500's problem lengths in characters, at every tenth of the sorted list (0%, 10%, ... 100%),
# read from ../shared/data/math500.jsonl; LaTeX-heavy text is about 3.5 characters a Llama-3 token.
MATH500_CHAR_DECILES = (20, 58, 78, 104, 125, 148, 177, 212, 267, 385, 1733)
CHARS_PER_TOKEN = 3.5
SYSTEM_PROMPT_TOKENS = 70  # Search-and-Learn's system prompt and the chat template, in Llama-3 tokens
SPLITS = (0.08, 0.1, 0.2, 0.3, 0.4, 0.5)  # the generator's fraction of the KV budget (the study's sweep)
MAX_IN_FLIGHT = 16  # problems searched at once (continuous problem batching)
CEILING = "unconstrained"  # the configuration with ceiling_scale x the budget
# Its split: the static splits' pages (16 tokens for either model), each side above what the search
# asks for at its deepest in 3x the budget (generator ~20% of the demand, PRM ~80%).
CEILING_FRACTIONS = {"gen": 0.3, "prm": 0.7}
# --founding-replica: KV bytes per token (2 x layers x kv heads x head dim x 4 in float32) 512 and 2,048,
# the 1:4 of the 1B (32 KiB a token in bfloat16) and the 8B (128 KiB), and the device models' vocabulary
# (a random model then ends a step by EOS as rarely as theirs; with 1,024 words the replica computed 3-9%
# fewer tokens than the device)
REPLICA_SHAPES = (
    dict(vocab_size=gm.LLAMA_3_2_1B["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-5),
    dict(vocab_size=gm.LLAMA_3_1_8B["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=4,
         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-5),
)
REPLICA_DTYPE = "float32"


def kv_bytes_per_token(shape: dict, dtype: torch.dtype) -> int:
    """A Llama shape's KV bytes a token, as the engine counts them (`kv_arena.kv_bytes_per_token`)."""
    config = parse_model_config({**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    return kv_arena.kv_bytes_per_token(config, dtype)


def replica_kv_scale() -> float:
    """The replica's KV budget over the device's: its generator's bytes per token over the 1B's in
    bfloat16 (the PRMs' keep the same ratio), so both hold the same number of pages."""
    replica = [kv_bytes_per_token(shape, torch.float32) for shape in REPLICA_SHAPES]
    device = [kv_bytes_per_token(shape, torch.bfloat16) for shape in (gm.LLAMA_3_2_1B, gm.LLAMA_3_1_8B)]
    if replica[1] * device[0] != device[1] * replica[0]:
        raise ValueError(f"REPLICA_SHAPES: KV bytes per token {replica}, not in the device models' ratio {device}")
    return replica[0] / device[0]


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


def configurations(splits, block_size: int, ceiling_scale: float = 0) -> list[tuple[str, dict]]:
    """(label, Runtime options): the static splits, the shared arena, the shared arena with
    pages of `block_size` generator tokens (the default page holds 16 generator tokens, so the 4x
    larger PRM gets 4 a page; with 64 it gets 16, as in its static share), and the unconstrained
    ceiling (a split with the static splits' pages in `ceiling_scale` x the budget)."""
    configs = [(f"static gen={f:g}", {"kv_mode": "static", "kv_fractions": {"gen": f, "prm": round(1 - f, 4)}})
               for f in splits]
    configs.append(("shared", {"kv_mode": "shared"}))
    if block_size:
        configs.append((f"shared, {block_size}-token pages", {"kv_mode": "shared", "block_size": block_size}))
    if ceiling_scale:
        configs.append((CEILING, {"kv_mode": "static", "kv_fractions": dict(CEILING_FRACTIONS),
                                  "kv_scale": ceiling_scale}))
    return configs


def load_models(args, paths: dict[str, Path]) -> dict:
    """Both models loaded once; every configuration's Runtime is built over these weights."""
    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_model import load_model

    return {name: load_model(EngineConfig(model=str(path), **engine_options(args)), name)
            for name, path in paths.items()}


def engine_options(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, load_format="dummy", max_model_len=args.founding_max_len,
                max_num_batched_tokens=8192, max_num_seqs=16 * MAX_IN_FLIGHT)


def build_runtime(args, loaded: dict, options: dict) -> Runtime:
    """A configuration's Runtime over the loaded models: its own KV space, engines and CUDA graphs
    (its engine options, a page size `block_size`, apply to the engines over the loaded weights)."""
    options = dict(options)
    budget = args.founding_kv_gib * options.pop("kv_scale", 1) * (1 << 30)
    return Runtime(loaded, kv_cache_memory_bytes=int(budget), recipes={"prm": None}, **options)  # (random: names no recipe)


def search_config(args, depth: int) -> SearchConfig:
    return SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=depth, max_tokens=args.step_tokens,
                        system_prompt=None, seed=0)


class StepLog:
    """A step observer: per engine step, (seconds since the run began, model, pages in use)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.rows: list[tuple[float, str, int]] = []

    def __call__(self, engine, outputs=None) -> None:
        self.rows.append((time.perf_counter() - self.start, engine.name, engine.stats().kv_blocks_in_use))

    def summary(self, points: int = 200) -> tuple[dict, dict]:
        """Per model: (seconds, pages in use) at most `points` times; its steps and the seconds they
        took (each step's time since the step before it, of either model)."""
        series: dict[str, list[list[float]]] = {}
        steps: dict[str, dict] = {}
        last = 0.0
        for t, model, in_use in self.rows:
            series.setdefault(model, []).append([round(t, 4), in_use])
            row = steps.setdefault(model, {"steps": 0, "seconds": 0.0})
            row["steps"] += 1
            row["seconds"] = round(row["seconds"] + t - last, 4)
            last = t
        return {model: values[::max(1, len(values) // points)] for model, values in series.items()}, steps


COUNTERS = ("num_tokens_computed", "num_steps", "num_graph_replays", "prefix_queries", "prefix_hits", "evictions",
            "thrash", "num_preemptions")


def run_one(args, rt: Runtime, label: str, problems: list[str], depth: int) -> dict:
    """One timed search on a configuration's Runtime, its caches reset first (every run starts
    with nothing cached); counters are this run's (after minus before)."""
    if not rt.reset_prefix_cache():
        raise RuntimeError(f"{label}: blocks still in use after the last run")
    before = {name: engine.stats() for name, engine in rt.engines.items()}
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"), max_problems_in_flight=MAX_IN_FLIGHT)
    log = StepLog()
    rt.loop.step_observers.append(log)
    gc.collect()
    _synchronize(args.device)
    start = log.start = time.perf_counter()
    try:
        runner.run(problems, search_config(args, depth))
        _synchronize(args.device)
        seconds = time.perf_counter() - start
    finally:
        rt.loop.step_observers.remove(log)
    after = {name: engine.stats() for name, engine in rt.engines.items()}
    count = {key: {n: getattr(after[n], key) - getattr(before[n], key) for n in after} for key in COUNTERS}
    evictors = {n: {by: k - before[n].thrash_by_evictor.get(by, 0) for by, k in after[n].thrash_by_evictor.items()}
                for n in after}
    series, steps = log.summary()
    row = {"label": label, "seconds": seconds, "problems_s": len(problems) / seconds,
           "tokens_computed": count["num_tokens_computed"],
           "hit_rate": {n: round(count["prefix_hits"][n] / q, 4) if q else 0.0 for n, q in count["prefix_queries"].items()},
           "evictions": count["evictions"], "thrash": count["thrash"], "thrash_by_evictor": evictors,
           "preemptions": count["num_preemptions"], "engine_steps": count["num_steps"],
           "graph_replays": count["num_graph_replays"],
           "kv_blocks": {n: s.kv_blocks_total for n, s in after.items()},
           "block_size": {n: s.block_size for n, s in after.items()}, "steps": steps, "blocks_in_use": series}
    print(f"  {label}: {row['problems_s']:.3f} problems/s ({seconds:.1f} s), tokens {row['tokens_computed']}, "
          f"hits {row['hit_rate']}, thrash {row['thrash']} (by evictor {evictors}), preemptions {row['preemptions']}, "
          f"steps {steps}, graph replays {row['graph_replays']}", flush=True)
    return row


def _synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def fixed_length_steps() -> None:
    """A step cut at its 64 tokens continues its beam, as the study's steps (ended by the model at
    a blank line) did. Random models never write the step delimiter, and Search-and-Learn's rule
    (kept by treeserve's strategies) ends a solution whose step hit the token limit: without this,
    every beam would end after its first step and the KV budget would never bind."""
    from treeserve.search import strategies

    strategies._ends_solution = lambda step: step.finish == "eos" or step.text == ""


def build_all(args, configs, loaded: dict, problems: list[str], result: dict) -> dict[str, Runtime]:
    """Every configuration's Runtime, built once (graphs captured) and warmed up by a short search
    (Triton compiles per cache block size, which differs between configurations)."""
    runtimes = {}
    for label, options in configs:
        start = time.perf_counter()
        try:
            runtimes[label] = build_runtime(args, loaded, options)
            run_one(args, runtimes[label], f"warm-up ({label})", problems[:2], min(2, args.search_depth))
        except Exception as exc:  # a split too small for the workload: say so, go on
            result["runs"][label].append({"label": label, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {label}: {result['runs'][label][-1]['error']}", flush=True)
            runtimes.pop(label, None)
        result["build_seconds"][label] = round(time.perf_counter() - start, 2)
    return runtimes


def run_founding_study(args, paths: dict[str, Path], vocab: int, write) -> dict:
    """Every configuration built and warmed up, then `args.founding_repeats` alternated rounds (after
    the first round, no run starts once `args.founding_seconds` have passed); `write(result)`
    after every run."""
    fixed_length_steps()
    problems = questions(args.search_problems, vocab, seed=1, smoke=args.smoke)
    configs = configurations(args.splits, args.founding_block_size, args.founding_ceiling)
    result: dict = {"kv_budget_gib": args.founding_kv_gib, "device_kv_budget_gib": args.founding_device_kv_gib,
                    "ceiling_kv_scale": args.founding_ceiling,
                    "replica": args.founding_replica, "problems": len(problems), "depth": args.search_depth,
                    "step_tokens": args.step_tokens, "question_tokens": [len(q.split()) for q in problems],
                    "build_seconds": {}, "runs": {label: [] for label, _ in configs}}
    started = time.perf_counter()
    loaded = load_models(args, paths)
    runtimes = build_all(args, configs, loaded, problems, result)
    freeze_startup_heap()  # the built runtimes live until the end: no full collection walks them mid-run
    write(result)
    try:
        timed_rounds(args, runtimes, problems, result, started, write)
        if args.founding_profile:
            profile_runs(args, runtimes, problems, result, write)
    finally:
        for rt in runtimes.values():
            rt.close()
        gc.unfreeze()  # the closed runtimes' cycles (and their KV arenas) can be collected again
        gc.collect()
    return result


def timed_rounds(args, runtimes: dict[str, Runtime], problems: list[str], result: dict, started: float, write) -> None:
    """`args.founding_repeats` rounds, each configuration once in a seeded order; after the first
    round, no run starts once `args.founding_seconds` have passed since `started`."""
    for repeat in range(args.founding_repeats):
        print(f"round {repeat + 1}/{args.founding_repeats}", flush=True)
        for label in random.Random(repeat).sample(list(runtimes), len(runtimes)):
            if repeat and time.perf_counter() - started > args.founding_seconds:
                result["cut"] = f"round {repeat + 1} cut before {label}: past {args.founding_seconds} s"
                print(result["cut"], flush=True)
                return
            result["runs"][label].append(run_one(args, runtimes[label], label, problems, args.search_depth))
            result["summary"] = summarize(result["runs"])
            write(result)


def profile_runs(args, runtimes: dict[str, Runtime], problems: list[str], result: dict, write) -> None:
    """One more run of the shared arena and of the best static split, profiled per model
    (gpu_founding_profile); not counted in the rounds."""
    labels = [label for label in ("shared", result.get("summary", {}).get("best_static")) if label in runtimes]
    result["profiles"] = {}
    for label in labels:
        rt = runtimes[label]
        row = gpu_founding_profile.profiled_run(lambda: run_one(args, rt, f"profiled {label}", problems, args.search_depth),
                                                rt.engines, args.device)
        print(gpu_founding_profile.describe(label, row), flush=True)
        result["profiles"][label] = {key: row[key] for key in ("seconds", "tokens_computed", "profile")}
        write(result)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Median problems/s per configuration, the best static split, and shared against it (ratio of
    medians, and the median of the per-round ratios)."""
    medians = {}
    for label, rows in runs.items():
        rates = [r["problems_s"] for r in rows if "problems_s" in r]
        if rates:  # of an even count, the mean of the middle two (a cut round leaves two: not the faster)
            medians[label] = statistics.median(rates)
    static = {label: rate for label, rate in medians.items() if label.startswith("static")}
    summary: dict = {"median_problems_s": medians}
    if not static:
        return summary
    best = max(static, key=static.__getitem__)
    summary["best_static"] = best
    for label in (label for label in medians if label.startswith("shared") or label == CEILING):
        pairs = [s["problems_s"] / b["problems_s"] for s, b in zip(runs[label], runs[best])
                 if "problems_s" in s and "problems_s" in b]
        summary[f"{label} / best static"] = medians[label] / static[best]
        summary[f"{label} / best static, per round"] = sorted(pairs)
        if pairs:
            summary[f"{label} / best static, median of rounds"] = statistics.median(pairs)
    return summary


def table_rows(result: dict) -> list[list[str]]:
    summary = result.get("summary", {})
    best = summary.get("best_static")
    rows = []
    for label, rate in summary.get("median_problems_s", {}).items():
        ratio = summary.get(f"{label} / best static")
        target = "(the splits' pages, memory unbound)" if label == CEILING else ">= 1.1x best static"
        rows.append([f"1B+8B beam N=16 ({label})", f"{rate:.3f} problems/s",
                     f"{summary['median_problems_s'][best]:.3f} ({best})" if ratio else "",
                     f"{ratio:.2f}x" if ratio else "", target if ratio else ""])
    return rows


def plot(result: dict, path: Path) -> Path:
    """The study's figure: problems/s against the generator's KV fraction (each run a dot, medians
    joined), each shared-arena configuration a horizontal line at its median; beside it, the pages
    each model held over the shared arena's median run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: [r for r in rows if "problems_s" in r] for label, rows in result["runs"].items()}
    medians = result.get("summary", {}).get("median_problems_s", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    static = sorted((float(label.split("=")[1]), label) for label in runs if label.startswith("static") and runs[label])
    for split, label in static:
        left.plot([split] * len(runs[label]), [r["problems_s"] for r in runs[label]], ".", color="tab:blue", alpha=0.5)
    left.plot([s for s, _ in static], [medians[label] for _, label in static], "o-", color="tab:blue",
              label="static split (median)")
    for label, color in zip((label for label in runs if label.startswith("shared") and label in medians),
                            ("tab:red", "tab:orange")):
        left.axhline(medians[label], color=color, linestyle="--", label=f"{label} (median)")
    if CEILING in medians:
        left.axhline(medians[CEILING], color="gray", linestyle=":",
                     label=f"{CEILING}, {result['ceiling_kv_scale']:g}x the KV (median)")
    left.set(xlabel="KV fraction given to the generator", ylabel="problems / s",
             title=f"1B + 8B beam search N=16, {result['device_kv_budget_gib']:g} GiB of KV"
                   + (" (CPU replica)" if result.get("replica") else ""))
    left.legend(fontsize=8)
    shared = sorted(runs.get("shared", []), key=lambda r: r["problems_s"])
    if shared:
        median_run = shared[len(shared) // 2]
        for model, series in median_run["blocks_in_use"].items():
            right.plot([t for t, _ in series], [v for _, v in series], label=f"{model}")
        right.set(xlabel="seconds", ylabel="KV pages in use", title="shared arena: pages per model (median run)")
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # python benchmarks/gpu_founding.py OUT/gpu.json docs/founding_gpu.png
    import json
    import sys

    print(plot(json.loads(Path(sys.argv[1]).read_text())["founding_search"], Path(sys.argv[2])))
