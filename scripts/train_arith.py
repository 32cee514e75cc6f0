"""Trains the bundled arithmetic generator and PRM from scratch, reproducibly from a seed, on CPU.

Stages: tokenizer; generator (supervised on exact solutions); the generator samples solutions to
fresh training problems, and exact checking labels every step; PRM (RLHFlow verdicts) on those
samples plus corrupted reference solutions. Writes both checkpoints in Hugging Face format.

    python scripts/train_arith.py --out src/treeserve/models [--seed 0] [--gen-steps 3000] [--prm-steps 2000]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from treeserve import LLM, SamplingParams
from treeserve.search.config import STEP_DELIMITER
from treeserve.tasks.arithmetic import Problem, corrupted_steps, generate, step_labels
from treeserve.tasks.tokenizer import train_task_tokenizer
from treeserve.tasks.training import (GENERATOR_SHAPE, PRM_EXTRA_LAYERS, grow, Schedule, chat_ids, collate, lm_loss, new_model,
                                      one_level_batch, prm_example, save, sft_example, train, train_problems,
                                      verdict_loss)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def train_generator(tokenizer, args) -> Path:
    model = new_model(tokenizer, GENERATOR_SHAPE, args.seed)
    log(f"generator: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    rng = random.Random(f"gen:{args.seed}")

    def next_batch(step: int):
        return collate([sft_example(tokenizer, p) for p in one_level_batch(rng, args.batch_size)], tokenizer.pad_token_id)

    train(model, next_batch, lm_loss, Schedule(args.gen_steps, args.batch_size, lr=args.gen_lr), log=log)
    return save(model, tokenizer, args.out / "arith-gen")


def sample_solutions(gen_path: Path, problems: list[Problem], params: SamplingParams) -> list[list[list[str]]]:
    """Per problem, its sampled solutions, each split into steps, from treeserve's own engine."""
    llm = LLM(str(gen_path), dtype="float32", device="cpu", kv_cache_memory_bytes=256 << 20)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": chat_ids(tokenizer, [{"role": "user", "content": p.text}], True)} for p in problems]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[[s.strip() for s in c.text.split(STEP_DELIMITER) if s.strip()] for c in out.outputs] for out in outputs]


def prm_dataset(tokenizer, gen_path: Path, args) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(f"prm-data:{args.seed}")
    problems = train_problems(rng, args.prm_problems)
    params = SamplingParams(n=args.prm_samples, temperature=1.0, max_tokens=256, seed=args.seed)
    sampled = [(p, steps) for p, solutions in zip(problems, sample_solutions(gen_path, problems, params))
               for steps in solutions]
    # Reference solutions, whole and with one step corrupted, in equal numbers: a wrong step then
    # appears at every position, so the position of a step says nothing about its label.
    corrupted = [(p, corrupted_steps(p, rng)) for p in train_problems(rng, args.prm_problems)]
    references = [(p, p.steps()) for p in train_problems(rng, args.prm_problems)]
    examples, good, total = [], 0, 0
    for problem, steps in sampled + corrupted + references:
        labels = step_labels(problem, steps)
        good, total = good + sum(labels), total + len(labels)
        examples.append(prm_example(tokenizer, problem.text, steps, labels))
    log(f"prm data: {len(examples)} solutions ({len(sampled)} sampled), {total} steps, {good / total:.1%} good")
    return examples


def train_prm(tokenizer, gen_path: Path, examples, args) -> Path:
    import transformers

    generator = transformers.LlamaForCausalLM.from_pretrained(gen_path, dtype=torch.float32)
    model = grow(generator, PRM_EXTRA_LAYERS, args.seed + 1)
    log(f"prm: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    good_id, bad_id = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("+", "-"))
    rng = random.Random(f"prm:{args.seed}")

    by_length = sorted(examples, key=lambda e: len(e[0]))

    def next_batch(step: int):  # neighbours in length, so little compute goes to padding
        start = rng.randrange(len(by_length) - args.batch_size + 1)
        return collate(by_length[start:start + args.batch_size], tokenizer.pad_token_id)

    def loss_fn(model, ids, targets, mask):
        return verdict_loss(model, ids, targets, mask, good_id, bad_id)

    train(model, next_batch, loss_fn, Schedule(args.prm_steps, args.batch_size, lr=args.prm_lr), log=log)
    return save(model, tokenizer, args.out / "arith-prm")


def greedy_accuracy(gen_path: Path, count: int = 200) -> dict:
    problems = generate("validation", count, seed=0)
    solutions = sample_solutions(gen_path, problems, SamplingParams(temperature=0.0, max_tokens=256))
    by_level: dict[int, list[bool]] = {}
    for problem, [steps] in zip(problems, solutions):
        by_level.setdefault(problem.level, []).append(steps == problem.steps())
    overall = [ok for oks in by_level.values() for ok in oks]
    return {"overall": sum(overall) / len(overall), **{str(k): sum(v) / len(v) for k, v in sorted(by_level.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--gen-steps", type=int, default=3000)
    parser.add_argument("--gen-lr", type=float, default=2e-3)
    parser.add_argument("--prm-steps", type=int, default=2000)
    parser.add_argument("--prm-lr", type=float, default=1e-3)
    parser.add_argument("--prm-problems", type=int, default=4000)
    parser.add_argument("--prm-samples", type=int, default=4)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--stages", default="gen,prm", help="comma-separated: gen, prm")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    start = time.perf_counter()
    tokenizer = train_task_tokenizer(seed=args.seed)
    stages = args.stages.split(",")
    gen_path = train_generator(tokenizer, args) if "gen" in stages else args.out / "arith-gen"
    report = {"seed": args.seed, "generator_greedy_validation": greedy_accuracy(gen_path, args.eval_problems)}
    log(f"generator greedy accuracy on {args.eval_problems} validation problems: {report['generator_greedy_validation']}")
    if "prm" in stages:
        train_prm(tokenizer, gen_path, prm_dataset(tokenizer, gen_path, args), args)
    report["seconds"] = round(time.perf_counter() - start)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"done in {report['seconds']} s: {json.dumps(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
