"""The bundled pair on the whole arithmetic format (issue #39), in one command:

- planted slips (tasks/slips.py) of every kind on grid problems: how often the PRM scores the
  slipped step below 0.5, how often it scores the right steps before it above 0.5, and the
  step-level AUC (right steps against slipped ones, all kinds pooled);
- the grid: every operation count 1-8 x operator sets {+,-}, {*}, {+,-,*}, `--per-cell` fresh
  test problems each (all of a cell's where it has fewer: one `*` has 41), accuracy of greedy
  decoding and of beam search (N=16) with the PRM;
- calibration: on the generator's own samples, step scores binned against the share of right steps.

    python scripts/eval_arith.py [--per-cell 40] [--slips 200] [--no-search] [--calibration 10]
        [--out bench_out/eval_arith] [--generator DIR] [--verifier DIR] [--verifier-recipe lm-likelihood] [--agg min]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from treeserve import SamplingParams
from treeserve.runtime.runtime import Runtime
from treeserve.search.config import (AGG_STRATEGIES, SAL_SYSTEM_PROMPT, STEP_DELIMITER, SearchConfig,
                                     declared_aggregation)
from treeserve.search.grading import grade
from treeserve.search.runner import SearchRunner
from treeserve.tasks.arithmetic import (GRID_MAX_OPERATIONS, GRID_OPERATORS, grid_cell_count, grid_problems,
                                        local_step_labels)
from treeserve.tasks.slips import KINDS, plant
from treeserve.tasks.training import chat_ids


def slip_report(rt: Runtime, per_kind: int, seed: int) -> dict:
    """Per kind: the share of slipped steps scored < 0.5 and of right steps scored > 0.5; and the AUC."""
    rng = random.Random(seed)
    cells = [(count, ops) for ops in GRID_OPERATORS for count in range(2, GRID_MAX_OPERATIONS + 1)]
    report, right_all, slipped_all = {}, [], []
    for kind in KINDS:
        items = []
        for i in range(per_kind):
            count, ops = cells[i % len(cells)]
            problem = grid_problems("test", count, ops, i // len(cells) + 1, seed)[-1]
            items.append((problem, *plant(problem, kind, rng)))
        scores = rt.score_many("prm", [(problem.text, steps) for problem, steps, _ in items])
        slipped = [s[index] for (_, _, index), s in zip(items, scores)]
        right = [x for (_, _, index), s in zip(items, scores) for x in s[:index]]
        report[kind] = {"slipped_below_half": _share(slipped, lambda x: x < 0.5),
                        "right_above_half": _share(right, lambda x: x > 0.5), "count": len(items)}
        right_all += right
        slipped_all += slipped
    report["step_auc"] = _auc(right_all, slipped_all)
    return report


def calibration_report(rt: Runtime, per_cell: int, seed: int, bins: int = 10) -> dict:
    """Do the step scores read as probabilities? On the generator's own samples (4 a problem,
    temperature 0.8, as search draws them) of fresh validation problems of every grid cell, each step
    is labelled by exact checking (right given the step before it: `local_step_labels`); the scores
    are binned by value and each bin's mean score set against its share of right steps. Reports the
    expected calibration error (the bins' gaps weighted by their counts) and the Brier score."""
    problems = [p for ops in GRID_OPERATORS for count in range(1, GRID_MAX_OPERATIONS + 1)
                for p in grid_problems("validation", count, ops, per_cell, seed)]
    tokenizer = rt.engine("gen").tokenizer
    prompts = [{"prompt_token_ids": chat_ids(tokenizer, [{"role": "user", "content": p.text}], True)} for p in problems]
    params = SamplingParams(n=4, temperature=0.8, max_tokens=256, seed=seed)
    items = [(p, [s.strip() for s in c.text.split(STEP_DELIMITER) if s.strip()])
             for p, out in zip(problems, rt.generate("gen", prompts, params)) for c in out.outputs]
    items = [(p, steps) for p, steps in items if steps]
    scores = rt.score_many("prm", [(p.text, steps) for p, steps in items])
    pairs = [(score, right) for (p, steps), step_scores in zip(items, scores)
             for score, right in zip(step_scores, local_step_labels(p, steps))]
    table = []
    for low in range(bins):
        inside = [(s, r) for s, r in pairs if low / bins <= s < (low + 1) / bins or (low == bins - 1 and s == 1.0)]
        if inside:
            table.append({"bin": f"{low / bins:.1f}-{(low + 1) / bins:.1f}", "steps": len(inside),
                          "mean_score": sum(s for s, _ in inside) / len(inside),
                          "right": sum(r for _, r in inside) / len(inside)})
    ece = sum(row["steps"] * abs(row["mean_score"] - row["right"]) for row in table) / len(pairs)
    brier = sum((s - r) ** 2 for s, r in pairs) / len(pairs)
    return {"steps": len(pairs), "right": sum(r for _, r in pairs) / len(pairs), "ece": ece, "brier": brier,
            "bins": table}


def grid_report(rt: Runtime, per_cell: int, seed: int, strategies: list[str], agg: str | None = None) -> dict:
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"))
    agg = agg or declared_aggregation(rt.engine("prm").model_dir)
    report: dict = {}
    for strategy in strategies:
        n = 1 if strategy == "greedy" else 16
        config = SearchConfig(strategy=strategy, n=n, beam_width=4, num_iterations=40, temperature=0.8,
                              max_tokens=2048, agg_strategy=agg, system_prompt=SAL_SYSTEM_PROMPT, seed=seed)
        for ops in GRID_OPERATORS:
            for count in range(1, GRID_MAX_OPERATIONS + 1):
                available = grid_cell_count("test", count, ops)  # one operation: 41-140 test problems
                problems = grid_problems("test", count, ops, min(per_cell, available or per_cell), seed)
                results = runner.run([p.text for p in problems], config)
                right = sum(grade(r.pred, str(p.answer)) for p, r in zip(problems, results))
                report.setdefault(strategy, {})[f"{ops} x{count}"] = right / len(problems)
                print(f"  {strategy} {ops:3s} {count} operations: {right}/{len(problems)}", flush=True)
    return report


def _share(values: list[float], ok) -> float:
    return sum(map(ok, values)) / len(values) if values else float("nan")


def _auc(good: list[float], bad: list[float]) -> float:
    pairs = len(good) * len(bad)
    return sum((g > b) + 0.5 * (g == b) for g in good for b in bad) / pairs if pairs else float("nan")


def print_calibration(calibration: dict) -> None:
    print(f"\ncalibration on the generator's samples ({calibration['steps']} steps, {calibration['right']:.1%} right): "
          f"ECE {calibration['ece']:.3f}, Brier {calibration['brier']:.4f}\n")
    print("| step score | steps | mean score | right |\n|---|---|---|---|")
    for row in calibration["bins"]:
        print(f"| {row['bin']} | {row['steps']} | {row['mean_score']:.3f} | {row['right']:.1%} |")


def print_tables(slips: dict, grid: dict) -> None:
    print("\nplanted slips (PRM step scores):\n\n| slip | slipped step < 0.5 | right steps before it > 0.5 |\n|---|---|---|")
    for kind in KINDS:
        row = slips[kind]
        print(f"| {kind} | {row['slipped_below_half']:.1%} | {row['right_above_half']:.1%} |")
    print(f"\nstep-level AUC (right against slipped, all kinds): {slips['step_auc']:.4f}")
    for strategy, cells in grid.items():
        print(f"\n{strategy}: accuracy by operator set (rows) and operation count (columns)\n")
        print("| operators | " + " | ".join(map(str, range(1, GRID_MAX_OPERATIONS + 1))) + " |")
        print("|---|" + "---|" * GRID_MAX_OPERATIONS)
        for ops in GRID_OPERATORS:
            values = [cells[f"{ops} x{count}"] for count in range(1, GRID_MAX_OPERATIONS + 1)]
            print(f"| {' '.join(ops)} | " + " | ".join(f"{v:.0%}" for v in values) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generator", default="builtin:arith-gen")
    parser.add_argument("--verifier", default="builtin:arith-prm")
    parser.add_argument("--verifier-recipe", default=None,
                        help="how the verifier reads steps (runtime/prm_recipes.py; default: its config's)")
    parser.add_argument("--agg", choices=AGG_STRATEGIES, default=None,
                        help="how search folds step scores (default: the verifier's declared aggregation)")
    parser.add_argument("--per-cell", type=int, default=40)
    parser.add_argument("--slips", type=int, default=200, help="planted slips of each kind")
    parser.add_argument("--strategies", default="greedy,beam")
    parser.add_argument("--no-search", action="store_true", help="no grid search")
    parser.add_argument("--calibration", type=int, default=10,
                        help="validation problems a grid cell for the calibration report (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out/eval_arith"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    recipes = {"prm": args.verifier_recipe}  # (None: the declared recipe, else RLHFlow's)
    rt = Runtime({"gen": args.generator, "prm": args.verifier}, recipes=recipes, dtype="float32", device="cpu")
    slips = slip_report(rt, args.slips, args.seed)
    calibration = calibration_report(rt, args.calibration, args.seed) if args.calibration else None
    grid = {} if args.no_search else grid_report(rt, args.per_cell, args.seed, args.strategies.split(","), args.agg)
    print_tables(slips, grid)
    if calibration:
        print_calibration(calibration)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"slips": slips, "calibration": calibration, "grid": grid}
    (args.out / "eval_arith.json").write_text(json.dumps(report, indent=1))
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {args.out / 'eval_arith.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
