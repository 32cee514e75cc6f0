"""Test-time search, treeserve against Search-and-Learn's execution (the reference mode), same run.

Beam search (N=16, beam width 4) and best-of-N (N=16) solve the same problems with the same
strategy code, models and seeds, once on treeserve's runner (continuous problem batching, forked
beams, incremental verifier with a score cache, shared KV arena) and once in the reference mode
(lockstep problem batches, prompts re-submitted as text, the verifier re-encoding whole
conversations in HF transformers, end-of-sequence sampling at maximum depth).

`--models builtin` (default) uses the bundled arith-gen and arith-prm on the arithmetic task's
test split, so accuracy means something and the two modes' accuracies can be compared.
`--models random` uses small random Llamas on MATH-500 (the generator biased to write
blank-line separated steps): accuracy is 0 for both and only speed is compared, on longer texts.

    python benchmarks/search_speed.py [--problems 50] [--strategies beam best_of_n] [--models builtin|random]
        [--dtype bfloat16|float32] [--repeats 5] [--reference-batch B] [--reference-prm-batch B]
        [--treeserve-only]

With `--repeats`, the two modes run alternately and the speed-up printed is the median of the
back-to-back pairs' ratios (this machine is shared and its speed drifts).

The reference uses S&L's own batch sizes (`treeserve.search.reference.sal_batch_sizes`): for beam
search one problem and one verifier conversation at a time (S&L's beam-search recipe for
Llama-3.2-1B-Instruct), otherwise 25 problems and 4 conversations (S&L's defaults).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from treeserve import Runtime
from treeserve.model.random_models import make_tiny_model
from treeserve.model.registry import cache_dir, resolve_model_path
from treeserve.search.config import SearchConfig
from treeserve.search.grading import grade
from treeserve.search.reference import HFStepScorer, ReferenceRunner, sal_batch_sizes
from treeserve.search.runner import SearchRunner
from treeserve.tasks.arithmetic import generate

DATASET = Path(__file__).resolve().parents[1] / "data" / "math500.jsonl"
GENERATOR = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096)
VERIFIER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=4096)
STEPWISE = {"\n": 5.4, "<|eos|>": 0.5}


def random_models() -> dict[str, str]:
    root = cache_dir() / "bench" / "search-speed"
    if not (root / "gen" / "config.json").is_file():
        make_tiny_model("llama", root / "gen", seed=0, favour_tokens=STEPWISE, **GENERATOR)
    if not (root / "prm" / "config.json").is_file():
        make_tiny_model("llama", root / "prm", seed=1, **VERIFIER)
    return {"gen": str(root / "gen"), "prm": str(root / "prm")}


def problems(path: Path, count: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:count]


def models_and_problems(args) -> tuple[dict[str, str], list[dict], str]:
    if args.models == "random":
        return random_models(), problems(args.dataset, args.problems), args.dataset.name
    rows = [p.row() for p in generate("test", args.problems, seed=args.seed)]
    return {"gen": args.generator, "prm": args.verifier}, rows, f"the arithmetic test split (seed {args.seed})"


def runtime(paths: dict[str, str], args) -> Runtime:
    return Runtime(paths, recipes={"prm": None}, dtype=args.dtype, device="cpu", kv_cache_memory_bytes=args.kv_mib << 20,
                   max_model_len=4096 if args.models == "random" else None, max_num_batched_tokens=4096)


class DistinctPrefixes:
    """Watches an engine's inputs and counts the tokens that no cache could have served: the nodes
    of the trie of every input submitted (a token whose whole prefix was submitted before is one
    an ideal cache holds). 1 - distinct / submitted is the ceiling on any reuse rate."""

    def __init__(self, engine):
        self.seen: set[int] = set()
        self.distinct = 0
        add_request = engine.add_request

        def watched(request_id, token_ids, *rest, **kwargs):
            self.observe(token_ids)
            return add_request(request_id, token_ids, *rest, **kwargs)
        engine.add_request = watched

    def observe(self, token_ids: list[int]) -> None:
        prefix = 0
        for token in token_ids:
            prefix = hash((prefix, token))
            if prefix not in self.seen:
                self.seen.add(prefix)
                self.distinct += 1


def measure(label: str, paths, rows, config: SearchConfig, args) -> dict:
    rt = runtime(paths, args)
    questions = [r["problem"] for r in rows]
    gen, prm = rt.engine("gen"), rt.engine("prm")
    trie = None
    if label == "reference":
        scorer = (HFStepScorer(str(resolve_model_path(paths["prm"])), prm.tokenizer, rt.recipes["prm"],
                               dtype=getattr(torch, args.dtype), max_len=prm.max_model_len)
                  if config.uses_verifier else None)
        runner = ReferenceRunner(gen, scorer, batch_size=args.reference_batch, prm_batch_size=args.reference_prm_batch)
    else:
        trie = DistinctPrefixes(prm)
        runner = SearchRunner(gen, rt.scorer("prm") if config.uses_verifier else None)
    start = time.perf_counter()
    results = runner.run(questions, config)
    seconds = time.perf_counter() - start
    prm_tokens = scorer.num_tokens_computed if label == "reference" and scorer else prm.num_tokens_computed
    submitted = runner.scorer.num_prompt_tokens if label != "reference" and runner.scorer else 0
    correct = sum(grade(r.pred, row["answer"]) for r, row in zip(results, rows))
    return {"label": label, "seconds": seconds, "problems_per_s": len(rows) / seconds,
            "generated_tokens_per_s": sum(r.completion_tokens for r in results) / seconds,
            "generated_tokens": sum(r.completion_tokens for r in results),
            "prm_tokens_per_problem": prm_tokens / len(rows), "accuracy": correct / len(rows),
            # verifier input tokens not recomputed: prefix-cache hits plus kept-KV forks
            "prm_hit_rate": 1 - prm_tokens / submitted if submitted else None,
            "prm_reuse_ceiling": 1 - trie.distinct / submitted if submitted else None,
            "tree_size": sum(r.tree_size for r in results),
            # steps too long for the verifier to read, given UNJUDGED_SCORE (long searches only)
            "unjudged_steps": runner.scorer.num_unjudged_steps if label != "reference" and runner.scorer else 0,
            # the reference's verifier time (HF transformers): what its generation cannot explain
            "verifier_seconds": scorer.seconds if label == "reference" and scorer else None}


def measure_interleaved(labels: tuple[str, ...], paths, rows, config: SearchConfig, args) -> dict[str, list[dict]]:
    """`args.repeats` runs of each mode, alternating, so that a busy spell on this shared machine
    falls on both modes rather than on one."""
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label in labels:
            runs[label].append(measure(label, paths, rows, config, args))
    if args.repeats > 1:
        for label in labels:
            print(f"{config.strategy:>10} {label:>9}: " + ", ".join(f"{r['seconds']:.1f} s" for r in runs[label]))
    return runs


def median_time_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def median_speedup(runs: dict[str, list[dict]]) -> float:
    """The median over repeats of reference time / treeserve time, each pair run back to back."""
    ratios = sorted(ref["seconds"] / ours["seconds"] for ref, ours in zip(runs["reference"], runs["treeserve"]))
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def report(strategy: str, runs: dict[str, dict]) -> bool:
    """Prints each mode's median-time run; False when there is no reference to compare with."""
    for run in runs.values():
        hit = ""
        if run["prm_hit_rate"] is not None:
            hit = f", PRM tokens reused {run['prm_hit_rate']:.1%} (ceiling {run['prm_reuse_ceiling']:.1%})"
        if run["unjudged_steps"]:
            hit += f", {run['unjudged_steps']} steps past the verifier's length"
        if run["verifier_seconds"] is not None:
            hit += f", verifier {run['verifier_seconds']:.1f} s ({run['verifier_seconds'] / run['seconds']:.0%})"
        print(f"{strategy:>10} {run['label']:>9}: {run['seconds']:7.1f} s, {run['problems_per_s']:.3f} problems/s, "
              f"{run['generated_tokens_per_s']:.1f} generated tok/s, {run['prm_tokens_per_problem']:.0f} PRM tokens "
              f"per problem, accuracy {run['accuracy']:.1%}, tree nodes {run['tree_size']}{hit}")
    if "reference" not in runs:
        return False
    computed, requested = runs["treeserve"]["prm_tokens_per_problem"], runs["reference"]["prm_tokens_per_problem"]
    if requested:
        # the reference computes every verifier token the search asks for: the same tree, no caches
        print(f"{strategy:>10}: verifier tokens not recomputed (score cache and prefix cache), against what the "
              f"search asks for: {1 - computed / requested:.1%}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", choices=["builtin", "random"], default="builtin")
    parser.add_argument("--generator", default="builtin:arith-gen", help="for --models builtin: another directory")
    parser.add_argument("--verifier", default="builtin:arith-prm", help="for --models builtin: another directory")
    parser.add_argument("--dataset", type=Path, default=DATASET, help="MATH-format JSONL for --models random")
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--num-iterations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="both modes, both models (bfloat16: what these CPUs are fast at, and S&L's)")
    parser.add_argument("--kv-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference-batch", type=int, default=None,
                        help="problems per lockstep batch in the reference (default: S&L's, 1 for beam search, else 25)")
    parser.add_argument("--reference-prm-batch", type=int, default=None,
                        help="conversations per verifier pass in the reference (default: S&L's, 1 for beam search, else 4)")
    parser.add_argument("--strategies", nargs="+", default=["beam", "best_of_n"])
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per mode, alternating; the median-time run is reported, and the median speed-up")
    parser.add_argument("--treeserve-only", action="store_true",
                        help="skip the reference (no speed-up): reuse figures for searches too long to run it on")
    args = parser.parse_args()
    paths, rows, source = models_and_problems(args)
    print(f"{len(rows)} problems from {source}, N={args.n}, beam width {args.beam_width}, "
          f"{args.num_iterations} iterations, {args.dtype} on CPU")
    speedups = {}
    for strategy in args.strategies:
        config = SearchConfig(strategy=strategy, n=args.n, beam_width=args.beam_width,
                              num_iterations=args.num_iterations, max_tokens=args.max_tokens, seed=args.seed)
        sal = sal_batch_sizes(strategy)
        print(f"{strategy}: the reference runs {args.reference_batch or sal.search} problem(s) per lockstep batch and "
              f"{args.reference_prm_batch or sal.prm} conversation(s) per verifier pass")
        labels = ("treeserve",) if args.treeserve_only else ("reference", "treeserve")
        runs = measure_interleaved(labels, paths, rows, config, args)
        if report(strategy, {label: median_time_run(r) for label, r in runs.items()}):
            speedups[strategy] = median_speedup(runs)
            print(f"{strategy} speed-up: {speedups[strategy]:.2f}" +
                  (f" (median of {args.repeats} back-to-back pairs)" if args.repeats > 1 else ""))
    if not args.treeserve_only:
        headline = speedups.get("beam", next(iter(speedups.values())))
        print(f"speed-up: {headline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
