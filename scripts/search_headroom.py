"""How much search can gain with a given arithmetic generator: its greedy accuracy beside beam
search and best-of-N guided by an exact-checking verifier (the ceiling any PRM can reach), with
optional Gaussian noise on that verifier's scores to see how much accuracy an imperfect PRM keeps.

The verifier scores step k 1.0 when steps 1..k are exactly right (`step_labels`), else 0.0, plus
noise of standard deviation `--sigma`, clipped to [0, 1]: sigma 0.5 ranks a right step above a wrong
one with probability about 0.92, sigma 1.0 about 0.76. Search runs through `ReferenceRunner`, which
only needs `score_many` (so end-of-sequence sampling at the last iteration is on, as in S&L).

    python scripts/search_headroom.py --generator runs/arith-models/arith-gen --dataset val100.jsonl \
        --n 16 --sigma 0,0.5,1 [--temperature 0.8]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from treeserve.config import EngineConfig
from treeserve.engine.llm_engine import LLMEngine
from treeserve.search.config import SearchConfig
from treeserve.search.grading import grade, majority_vote
from treeserve.search.reference import ReferenceRunner
from treeserve.tasks.arithmetic import parse_problem, step_labels


class ExactCheckingVerifier:
    def __init__(self, sigma: float, seed: int = 0):
        self.sigma, self.rng = sigma, random.Random(seed)

    def score_many(self, items: list[tuple[str, list[str]]], batch_size: int | None = None) -> list[list[float]]:
        """Exact labels, optionally noisy; `batch_size` (the reference's verifier batches) changes nothing."""
        return [[self._noisy(float(label)) for label in step_labels(parse_problem(question), steps)]
                for question, steps in items]

    def _noisy(self, score: float) -> float:
        return min(1.0, max(0.0, score + self.rng.gauss(0.0, self.sigma))) if self.sigma else score


def accuracy(results, answers: list[str], pick) -> float:
    return sum(grade(pick(result), answer) for result, answer in zip(results, answers)) / len(answers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generator", required=True)
    parser.add_argument("--dataset", type=Path, required=True, help="JSONL from `treeserve tasks export`")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--sigma", default="0", help="comma-separated noise levels of the verifier's scores")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = [json.loads(line) for line in args.dataset.read_text().splitlines() if line.strip()]
    questions, answers = [r["problem"] for r in rows], [r["answer"] for r in rows]
    engine = LLMEngine.from_config(EngineConfig(model=args.generator, dtype="float32", device="cpu",
                                    kv_cache_memory_bytes=256 << 20))

    def run(strategy: str, sigma: float, n: int):
        config = SearchConfig(strategy=strategy, n=n, beam_width=min(args.beam_width, n), temperature=args.temperature,
                              max_tokens=256, system_prompt=None, seed=args.seed)
        return ReferenceRunner(engine, ExactCheckingVerifier(sigma, args.seed)).run(questions, config)

    report = {"problems": len(rows), "n": args.n, "temperature": args.temperature,
              "greedy": accuracy(run("greedy", 0.0, 1), answers, lambda r: r.pred)}
    for sigma in [float(s) for s in args.sigma.split(",")]:
        sampled = run("best_of_n", sigma, args.n)
        report[f"sigma={sigma}"] = {
            "beam": accuracy(run("beam", sigma, args.n), answers, lambda r: r.pred),
            "best_of_n": accuracy(sampled, answers, lambda r: r.pred),
            "majority": accuracy(sampled, answers, lambda r: majority_vote(r.answers)),
            "pass@n": sum(any(grade(a, ans) for a in r.answers) for r, ans in zip(sampled, answers)) / len(rows)}
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
