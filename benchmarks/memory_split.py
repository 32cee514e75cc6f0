"""Static KV splits 0.1 ... 0.9 against the shared arena, on one generate-then-score workload.

`--pair random` (the default): two random tiny Llamas (a 4-layer generator, a 6-layer PRM with 3x
its bytes per token) and a tiny search loop (each round: every problem samples `width` candidate
steps from the generator, the PRM scores every candidate, the best one extends the problem), all
problems in lockstep. `--pair bundled`: the bundled arith-gen/arith-prm pair and treeserve's own
beam search (`SearchRunner`: N=16, width 4, 8 iterations, problems refilled as others finish) over
`--problems` arithmetic test problems, in float32 (4 KiB of KV a token for either model, on every
CPU): `--kv-mib 32` holds 8,192 tokens, where 32 problems in flight (16 candidates of ~100-250 tokens
each, sharing their beams' prefixes, and the PRM's conversations) do not fit and the static splits
preempt the generator hundreds of times.

Each configuration runs once per static split of the KV budget between generator and PRM, and once
in shared mode, in the same process, alternating over `--repeats`. Prints throughput for each and
`shared / best static: X.XX`; writes per-step traces and the figures. Two references run beside them
(unless `--no-bound`): `unconstrained` (KV_BOUND_FACTOR x the budget: the ceiling for any memory
policy) and `generator_alone` (the generator with the whole budget to itself, the verifier in an
unbounded pool beside it: no sharing policy gives the generator more pages or the verifier more hits,
so where it is no faster than the best split, the memory policy has nothing left to win).

    python benchmarks/memory_split.py [--problems 24] [--kv-mib 16] [--out bench_out/memory_split]
    python benchmarks/memory_split.py --pair bundled --problems 64 --kv-mib 32
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from plot_kv_telemetry import plot_all  # noqa: E402

from treeserve import Runtime, SamplingParams  # noqa: E402
from treeserve.errors import ParamError  # noqa: E402
from treeserve.model.random_models import make_tiny_model  # noqa: E402
from treeserve.model.registry import DEFAULT_GENERATOR, DEFAULT_VERIFIER, cache_dir  # noqa: E402
from treeserve.search.config import SearchConfig, declared_aggregation  # noqa: E402
from treeserve.search.grading import grade  # noqa: E402
from treeserve.search.runner import SearchRunner  # noqa: E402
from treeserve.tasks.arithmetic import generate as arithmetic_problems  # noqa: E402

SPLITS = [round(0.1 * i, 1) for i in range(1, 10)]
# The unconstrained run gets this many times the budget: nothing is evicted or preempted, so its
# throughput is the ceiling that no split and no shared-arena policy can pass on this workload.
KV_BOUND_FACTOR = 16
# The generator alone in the whole budget, the verifier in a pool KV_BOUND_FACTOR x the budget beside
# it: the most memory any sharing policy can give the generator, with none of the verifier's pages ever
# lost. Its fraction of (1 + KV_BOUND_FACTOR) x the budget, a hair over so that rounding keeps every page.
GENERATOR_ALONE_FRACTION = 1 / (1 + KV_BOUND_FACTOR) + 1e-9
GENERATOR = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
VERIFIER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=1024)


def models(pair: str = "random") -> dict[str, Path | str]:
    if pair == "bundled":
        return {"gen": DEFAULT_GENERATOR, "prm": DEFAULT_VERIFIER}
    root = cache_dir() / "bench" / "memory-split"
    paths = {"gen": root / "gen", "prm": root / "prm"}
    if not (paths["gen"] / "config.json").is_file():
        make_tiny_model("llama", paths["gen"], seed=0, **GENERATOR)
    if not (paths["prm"] / "config.json").is_file():
        make_tiny_model("llama", paths["prm"], seed=1, **VERIFIER)
    return paths


def problems(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "add the two numbers then double it and take away three times the total of four and five".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(12, 30))) + "?" for _ in range(count)]


def search(rt: Runtime, questions: list[str], rounds: int, width: int, max_tokens: int) -> list[list[str]]:
    chosen: list[list[str]] = [[] for _ in questions]
    for r in range(rounds):
        prompts = [q + " " + " ".join(steps) for q, steps in zip(questions, chosen)]
        params = SamplingParams(n=width, temperature=1.0, seed=1000 + r, max_tokens=max_tokens, ignore_eos=True)
        outputs = rt.generate("gen", prompts, params)
        items = [(q, steps + [c.text]) for q, steps, out in zip(questions, chosen, outputs) for c in out.outputs]
        scores = rt.score_many("prm", items)
        for i, steps in enumerate(chosen):
            block = scores[i * width:(i + 1) * width]
            best = max(range(width), key=lambda j: block[j][-1])
            steps.append(items[i * width + best][1][-1])
    return chosen


def beam_search(rt: Runtime, rows: list[dict]) -> tuple[list[list[str]], float]:
    """`--pair bundled`: treeserve's beam search over the problems; each one's chosen completion and
    its answer, and the accuracy."""
    config = SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=8, max_tokens=256, seed=0,
                          agg_strategy=declared_aggregation(rt.engine("prm").model_dir))
    results = SearchRunner(rt.engine("gen"), rt.scorer("prm")).run([row["problem"] for row in rows], config)
    accuracy = sum(grade(r.pred, row["answer"]) for r, row in zip(results, rows)) / len(rows)
    return [[r.completions[r.chosen], str(r.pred)] for r in results], accuracy


# Each workload's model lengths: the bundled pair's 8 beam steps reach a few hundred tokens
LENGTHS = {"random": dict(max_model_len=256, max_num_batched_tokens=1024), "bundled": dict(max_model_len=512)}


def workload(args) -> Callable[[Runtime], tuple[list, float | None]]:
    """The search to time, its inputs made beforehand: (each problem's result, accuracy or None)."""
    if args.pair == "bundled":
        rows = [p.row() for p in arithmetic_problems("test", args.problems, seed=args.seed)]
        return lambda rt: beam_search(rt, rows)
    questions = problems(args.problems, args.seed)
    return lambda rt: (search(rt, questions, args.rounds, args.width, args.max_tokens), None)


def run(paths, label: str, args, out: Path, kv_mib: int | None = None, **runtime_options) -> dict:
    trace = out / f"trace_{label}.jsonl"
    rt = Runtime({k: str(v) for k, v in paths.items()}, recipes={"prm": None}, dtype="float32", device=args.device,
                 kv_cache_memory_bytes=(kv_mib or args.kv_mib) << 20, trace_path=trace, **LENGTHS[args.pair],
                 **runtime_options)
    go = workload(args)
    gc.collect()  # the runs before this one leave garbage: its collection is not this run's work
    start, start_cpu = time.perf_counter(), time.process_time()
    chosen, accuracy = go(rt)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    rt.close()
    tokens = sum(e.num_tokens_computed for e in rt.engines.values())
    stats = {name: e.stats() for name, e in rt.engines.items()}
    return {"label": label, "seconds": elapsed, "problems_per_s": len(chosen) / elapsed, "accuracy": accuracy,
            "cpu_seconds": cpu, "problems_per_cpu_s": len(chosen) / cpu,
            "tokens_computed": tokens, "chosen": chosen, "trace": trace.name,
            "preemptions": {n: s.num_preemptions for n, s in stats.items()},
            "kv_blocks": {n: s.kv_blocks_total for n, s in stats.items()},
            "tokens_computed_by_model": {n: e.num_tokens_computed for n, e in rt.engines.items()},
            "hit_rate": {n: (s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0) for n, s in stats.items()},
            "thrash": {n: s.thrash for n, s in stats.items()}, "evictions": {n: s.evictions for n, s in stats.items()},
            "thrash_by_evictor": {n: s.thrash_by_evictor for n, s in stats.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("random", "bundled"), default="random",
                        help="random tiny models and a lockstep loop, or the bundled pair and treeserve's beam search")
    parser.add_argument("--problems", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=16, help="KV budget shared by both models, MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration (median reported)")
    parser.add_argument("--splits", type=float, nargs="+", default=SPLITS, help="generator fractions to sweep")
    parser.add_argument("--out", type=Path, default=Path("bench_out/memory_split"))
    parser.add_argument("--no-bound", action="store_true", help="skip the unconstrained run (the ceiling any "
                        "memory policy could reach: the same search with KV_BOUND_FACTOR x the budget) and the "
                        "generator-alone run (the generator with the whole budget, the verifier unbounded beside it: "
                        "what giving the generator every page could reach)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's); on a "
                        "shared 2-core machine one thread gives steadier ratios than two")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = models(args.pair)

    # Every configuration runs `repeats` times, interleaved, and keeps its median run: on a shared,
    # noisy machine one run of the same configuration varies by more than the splits differ (and
    # the first run after a configuration change was seen to be slower, whichever it was).
    configs = [(f"static_{split}", dict(kv_mode="static", kv_fractions={"gen": split, "prm": round(1 - split, 1)}))
               for split in args.splits] + [("shared", dict(kv_mode="shared"))]
    if not args.no_bound:
        configs.append(("unconstrained", dict(kv_mode="shared", kv_mib=args.kv_mib * KV_BOUND_FACTOR)))
        configs.append(("generator_alone", dict(kv_mode="static", kv_mib=args.kv_mib * (1 + KV_BOUND_FACTOR),
                                                kv_fractions={"gen": GENERATOR_ALONE_FRACTION,
                                                              "prm": 1 - GENERATOR_ALONE_FRACTION})))
    runs: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for repeat in range(args.repeats):
        # a new order each repeat (seeded): no configuration always runs first, or after the same one
        for label, options in random.Random(repeat).sample(configs, len(configs)):
            if label not in runs:
                continue
            try:
                runs[label].append(run(paths, label, args, args.out, **options))
            except ParamError as exc:
                if not label.startswith("static_"):
                    raise
                print(f"{label}: skipped, its share of the budget cannot run this workload ({exc})", flush=True)
                del runs[label]
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    args.splits = [split for split in args.splits if f"static_{split}" in runs]
    if not args.splits:
        raise SystemExit("no static split could run: raise --kv-mib")
    medians = {label: sorted(rs, key=lambda r: r["problems_per_s"])[len(rs) // 2] for label, rs in runs.items()}
    for label, rs in runs.items():
        medians[label]["problems_per_cpu_s"] = sorted(r["problems_per_cpu_s"] for r in rs)[len(rs) // 2]
    results = []
    for split in args.splits:
        result = medians[f"static_{split}"] | {"split": split}
        results.append(result)
        print(f"static gen={split:.1f}: {result['problems_per_s']:.3f} problems/s, "
              f"{result['problems_per_cpu_s']:.3f} per CPU-s (medians of {args.repeats}; "
              f"{result['tokens_computed']} tokens computed, preemptions {result['preemptions']}, hit rate "
              f"{ {k: round(v, 3) for k, v in result['hit_rate'].items()} })", flush=True)
    shared = medians["shared"]
    print(f"shared: {shared['problems_per_s']:.3f} problems/s, {shared['problems_per_cpu_s']:.3f} per CPU-s "
          f"(medians of {args.repeats}; {shared['tokens_computed']} "
          f"tokens computed {shared['tokens_computed_by_model']}, "
          f"hit rate { {k: round(v, 3) for k, v in shared['hit_rate'].items()} })")
    # whose allocations evicted the blocks each model asked for again (its own, or the other model's)
    print(f"shared: thrash by the evicting model {shared['thrash_by_evictor']}")
    best = max(results, key=lambda r: r["problems_per_s"])
    print(f"best static split: gen={best['split']:.1f}")
    same = all(r["chosen"] == shared["chosen"] for rs in runs.values() for r in rs)
    print(f"identical search results in every run: {'yes' if same else 'no'}")
    if shared["accuracy"] is not None:
        accuracies = sorted({r["accuracy"] for rs in runs.values() for r in rs})
        print(f"accuracy: {', '.join(f'{a:.1%}' for a in accuracies)} (every run)")
    print(f"shared / best static: {shared['problems_per_s'] / best['problems_per_s']:.2f}")
    # CPU time is what the process itself consumed: less sensitive to other tenants than wall time.
    best_cpu = max(results, key=lambda r: r["problems_per_cpu_s"])
    print(f"by CPU time: best static gen={best_cpu['split']:.1f}, "
          f"shared / best static: {shared['problems_per_cpu_s'] / best_cpu['problems_per_cpu_s']:.2f}")
    print(f"best static split's tokens computed: {best['tokens_computed_by_model']}")
    if "unconstrained" in medians:
        bound = medians["unconstrained"]
        print(f"unconstrained ({KV_BOUND_FACTOR}x the KV budget): {bound['problems_per_s']:.3f} problems/s, "
              f"{bound['tokens_computed']} tokens computed {bound['tokens_computed_by_model']}; the ceiling for "
              f"shared / best static: {bound['problems_per_s'] / best['problems_per_s']:.2f}")
    if "generator_alone" in medians:
        alone = medians["generator_alone"]
        print(f"generator alone in the budget (the verifier unbounded beside it): {alone['problems_per_s']:.3f} "
              f"problems/s, {alone['tokens_computed']} tokens computed {alone['tokens_computed_by_model']}; what "
              f"sharing alone can reach, shared / best static: {alone['problems_per_s'] / best['problems_per_s']:.2f}")
    print_pairs(runs, f"static_{best['split']}")
    summary = {"config": vars(args) | {"out": str(args.out)}, "static": results, "shared": shared,
               "unconstrained": medians.get("unconstrained"), "generator_alone": medians.get("generator_alone"),
               "problems_per_s_by_repeat": {label: [r["problems_per_s"] for r in rs] for label, rs in runs.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    for figure in plot_all(args.out):
        print(f"wrote {figure}")
    return 0


def print_pairs(runs: dict[str, list[dict]], best: str) -> None:
    """Each repeat's shared run against the same repeat's best-split run: runs close in time see
    the same machine, so the median of these ratios is less noisy than a ratio of medians."""
    ratios = sorted(s["problems_per_s"] / b["problems_per_s"] for s, b in zip(runs["shared"], runs[best]))
    print(f"shared / {best} by repeat: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {ratios[len(ratios) // 2]:.2f})")
    for label, rs in runs.items():
        rates = ", ".join(f"{r['problems_per_s']:.2f}" for r in rs)
        print(f"  {label}: {rates} problems/s")


if __name__ == "__main__":
    sys.exit(main())
