"""Trains the bundled arithmetic generator and verifier from scratch, reproducibly from a seed, on CPU.

Default stages (`--stages lm,verifier`, the whole format: 1-8 operations of any mix of + - *):
a tokenizer; a language model supervised on exact solutions for `--lm-steps`, whose checkpoint at
`--gen-step` (default: the last) is the generator, imperfect enough to make the slips search is
for; then the verifier, a second language model of the same shape with its own seed, trained
longer (`--verifier-steps`) on the same kind of data and read by the `lm-likelihood` recipe (a step
scores as the lowest probability it gives any of the step's tokens; its config.json names the
recipe and `min` aggregation). Both checkpoints are written in Hugging Face format.

`--stages lm,prm --format levels --gen-step 1500` trains the earlier pair instead: a PRM that is the
finished language model grown by three layers, read by the `chat-steps` recipe and trained on
`+`/`-` verdicts after every step, first on reference solutions with one corrupted step, then on
the generator's own samples labelled by exact checking (`--prm-labels local`: is the step right
given the step before it), helped by training-only heads (`treeserve.tasks.training.prm_loss`).
`--stages router` trains the tool router (`builtin:arith-router`):

    python scripts/train_arith.py --out src/treeserve/models [--seed 0]
    python scripts/train_arith.py --out src/treeserve/models --stages router
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from treeserve import LLM, SamplingParams
from treeserve.config import cpu_has_fast_bf16
from treeserve.runtime.prm_recipes import RECIPES
from treeserve.search.config import STEP_DELIMITER
from treeserve.tasks.arithmetic import (GRID_MAX_OPERATIONS, GRID_OPERATORS, Problem, corrupted_steps, generate,
                                        grid_problems, local_reference_steps, local_step_labels,
                                        local_step_results, step_labels)
from treeserve.tasks.router import CHAT_TEMPLATE as ROUTER_CHAT_TEMPLATE
from treeserve.tasks.router import PIECES as ROUTER_PIECES
from treeserve.tasks.router import SPECIAL_TOKENS as ROUTER_SPECIAL_TOKENS
from treeserve.tasks.router import RouterExample, router_example, tool_names
from treeserve.tasks.slips import KINDS, plant
from treeserve.tasks.tokenizer import train_bpe_tokenizer, train_task_tokenizer
from treeserve.tasks.training import (FORMATS, IGNORE, GENERATOR_SHAPE, PRM_EXTRA_LAYERS, PRMLossWeights, Schedule,
                                      add_training_heads, chat_ids, collate, drop_training_heads, grow, lm_loss,
                                      new_model, one_level_batch, prm_example, prm_loss,
                                      prm_reading_example, save, sft_example, shared_prefix_loss,
                                      split_shared_prefix, train,
                                      train_problems)


def training_autocast(choice: str) -> torch.dtype | None:
    if choice == "auto":
        return torch.bfloat16 if cpu_has_fast_bf16() else None
    return torch.bfloat16 if choice == "bfloat16" else None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def solution_batches(tokenizer, rng: random.Random, args):
    """`next_batch` for language-model training: exact solutions, one level (or grid cell) a batch."""

    def next_batch(step: int):
        return collate([sft_example(tokenizer, p) for p in one_level_batch(rng, args.batch_size, args.whole)],
                       tokenizer.pad_token_id)

    return next_batch


def train_language_model(tokenizer, args) -> tuple[Path, Path]:
    """Trains for `--lm-steps`; returns (the generator: the checkpoint at `--gen-step`, the final model)."""
    model = new_model(tokenizer, GENERATOR_SHAPE, args.seed)
    log(f"language model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    next_batch = solution_batches(tokenizer, random.Random(f"gen:{args.seed}"), args)
    gen_path, final_path = args.out / "arith-gen", args.work / "lm-final"

    def after_step(step: int, model) -> None:
        if step == args.gen_step:
            save(model, tokenizer, gen_path)
        if args.eval_every and step % args.eval_every == 0:
            path = save(model, tokenizer, args.work / "lm-checkpoints" / f"step-{step}")
            log(f"greedy validation accuracy at step {step}: {greedy_accuracy(path, args.eval_problems, args.whole)}")

    train(model, next_batch, lm_loss, Schedule(args.lm_steps, args.batch_size, lr=args.gen_lr), log=log,
          after_step=after_step, autocast=args.autocast)
    return gen_path, save(model, tokenizer, final_path)


def train_verifier(tokenizer, args) -> Path:
    """The bundled verifier: a second language model of the generator's shape, trained on exact
    solutions with its own seed and for `--verifier-steps`, read by the `lm-likelihood` recipe (a
    step scores as the lowest probability the verifier gives any of its tokens; see
    runtime/prm_recipes.py). Its own initialisation and data make it sure where the generator
    slips: the generator scoring its own samples approves its confident slips."""
    seed = args.seed + 1
    model = new_model(tokenizer, GENERATOR_SHAPE, seed)
    log(f"verifier: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, seed {seed}")
    next_batch = solution_batches(tokenizer, random.Random(f"verifier:{seed}"), args)

    def after_step(step: int, model) -> None:
        if args.eval_every and step % (2 * args.eval_every) == 0:
            save(model, tokenizer, args.work / "verifier-checkpoints" / f"step-{step}")

    train(model, next_batch, lm_loss, Schedule(args.verifier_steps, args.batch_size, lr=args.gen_lr), log=log,
          after_step=after_step, autocast=args.autocast)
    model.config.prm_recipe = "lm-likelihood"  # read by treeserve wherever no recipe is given
    model.config.prm_aggregation = "min"  # a step's score says nothing of the steps before it
    return save(model, tokenizer, args.out / "arith-prm")


def router_prompt(tokenizer, question: str, tools: tuple[str, ...]) -> str:
    """The router's prompt as the server renders tools mode's request (the gateway's system prompt
    and tool definitions, through the pydantic request model and `render_chat`); with no tokenizer,
    rendered by the router's own template (its tokenizer's corpus)."""
    from treeserve.entrypoints.chat_utils import render_chat
    from treeserve.gateway.chat.tools import ANSWER, HTTP_TOOLS, ROUTER_PROMPT, SYMPY
    from treeserve.wire.tools import Tool

    if tokenizer is None:
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, "x")),
                                            bos_token="<|bos|>")
        tokenizer.chat_template = ROUTER_CHAT_TEMPLATE
    definitions = [SYMPY, *(HTTP_TOOLS[name] for name in sorted(tools)), ANSWER]
    return render_chat(tokenizer, [{"role": "system", "content": ROUTER_PROMPT}, {"role": "user", "content": question}],
                       [Tool.model_validate(d).model_dump(exclude_none=True) for d in definitions])


def router_sft_example(tokenizer, example: RouterExample, tools: tuple[str, ...]) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode(router_prompt(tokenizer, example.question, tools), add_special_tokens=False)
    answer = tokenizer.encode(example.target, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + answer, [IGNORE] * len(prompt) + answer


def train_router(args) -> Path:
    """The tool router (`builtin:arith-router`): its own tokenizer and a small model trained from
    scratch on tools mode's prompts and the calls the server's grammar writes."""
    rng = random.Random(f"router:{args.seed}")
    every_tool = ("weather", "wikipedia")
    examples = [router_example(rng, every_tool) for _ in range(3000)]
    corpus = [e.question + "\n" + e.target for e in examples] + [router_prompt(None, "", every_tool)] * 50
    # bare digits: an expression is the same tokens in the message and in the call (copying is matching)
    tokenizer = train_bpe_tokenizer(corpus, 2000, ROUTER_SPECIAL_TOKENS, "<|im_end|>", ROUTER_CHAT_TEMPLATE,
                                    pieces=ROUTER_PIECES)
    longest = max(len(router_sft_example(tokenizer, router_example(rng, ("weather", "wikipedia")),
                                         ("weather", "wikipedia"))[0]) for _ in range(50))
    shape = dataclasses.replace(GENERATOR_SHAPE, num_hidden_layers=args.router_layers)
    # untied: a variable's name is copied from the message, never predicted from its context, and
    # tied embeddings let the six names collapse into one (see new_model)
    model = new_model(tokenizer, shape, args.seed, max_positions=1024, tie_embeddings=False)
    log(f"router: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
        f"longest prompt with every tool ~{longest} tokens")

    def next_batch(step: int):  # one set of tools a batch: the rows share their system prompt, run once
        tools = tool_names(rng)
        examples = [router_sft_example(tokenizer, router_example(rng, tools), tools)
                    for _ in range(args.router_batch_size)]
        return split_shared_prefix(examples, tokenizer.pad_token_id)

    train(model, next_batch, shared_prefix_loss, Schedule(args.router_steps, args.router_batch_size, lr=args.gen_lr),
          log=log, autocast=args.autocast)
    return save(model, tokenizer, args.out / "arith-router")


def router_accuracy(path: Path, count: int, seed: int) -> dict:
    """Greedy calls (no grammar) on fresh messages, exactly the expected text, by kind of call."""
    rng = random.Random(f"router-eval:{seed}")
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=256 << 20)
    tokenizer = llm.get_tokenizer()
    cases = [(tools, router_example(rng, tools)) for tools in (tool_names(rng) for _ in range(count))]
    prompts = [{"prompt_token_ids": tokenizer.encode(router_prompt(tokenizer, e.question, tools), add_special_tokens=False)}
               for tools, e in cases]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)
    right: dict[str, list[bool]] = {}
    for (_, example), output in zip(cases, outputs):
        kind = example.arguments.get("operation", example.name)
        right.setdefault(kind, []).append(output.outputs[0].text.strip() == example.target)
    return {kind: round(sum(v) / len(v), 3) for kind, v in sorted(right.items())} | {
        "all": round(sum(sum(v) for v in right.values()) / count, 3)}


def sample_solutions(gen_path: Path, problems: list[Problem], params: SamplingParams) -> list[list[list[str]]]:
    """Per problem, its sampled solutions, each split into steps, from treeserve's own engine."""
    llm = LLM(str(gen_path), dtype="float32", device="cpu", kv_cache_memory_bytes=256 << 20)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": chat_ids(tokenizer, [{"role": "user", "content": p.text}], True)} for p in problems]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[[s.strip() for s in c.text.split(STEP_DELIMITER) if s.strip()] for c in out.outputs] for out in outputs]


def cached_samples(gen_path: Path, problems: list[Problem], params: SamplingParams, args) -> list[list[list[str]]]:
    """`sample_solutions`, kept in the work directory under the generator's weights' hash and the
    sampling settings, so PRM-only reruns skip the sampling (deterministic from the seed anyway)."""
    weights = hashlib.sha256((gen_path / "model.safetensors").read_bytes()).hexdigest()[:12]
    path = args.work / f"prm-samples-{weights}-{len(problems)}x{params.n}-seed{args.seed}.json"
    if path.is_file():
        log(f"prm data: reusing the samples in {path}")
        return json.loads(path.read_text())
    solutions = sample_solutions(gen_path, problems, params)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(solutions))
    return solutions


def prm_dataset(tokenizer, gen_path: Path, args) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(f"prm-data:{args.seed}")
    problems = train_problems(rng, args.prm_problems, whole=args.whole)
    params = SamplingParams(n=args.prm_samples, temperature=1.0, max_tokens=256, seed=args.seed)
    sampled = [(p, steps) for p, solutions in zip(problems, cached_samples(gen_path, problems, params, args))
               for steps in solutions]
    # Reference solutions, whole and with one step corrupted, in equal numbers: a wrong step then
    # appears at every position, so the position of a step says nothing about its label.
    corrupted = [(p, corrupt(p, rng, args, shares=False)) for p in train_problems(rng, args.prm_problems, whole=args.whole)]
    references = [(p, p.steps()) for p in train_problems(rng, args.prm_problems, whole=args.whole)]
    examples = [e for e in (labelled_example(tokenizer, p, steps, args) for p, steps in sampled + corrupted + references)
                if e is not None]
    verdicts = [v for example in examples for v in example[1] if v != IGNORE]
    log(f"prm data: {len(examples)} solutions ({len(sampled)} sampled), {len(verdicts)} steps, "
        f"{sum(verdicts) / len(verdicts):.1%} good")
    return examples


def labelled_example(tokenizer, problem: Problem, steps: list[str], args):
    """`prm_example` for a solution labelled by exact checking; None if it cannot be used."""
    if not steps:
        return None
    labels, results = verdict_targets(problem, steps, args.prm_labels)
    local = args.prm_labels == "local"
    expected = None  # token verdicts cost a re-tokenization: only when they are trained
    if args.prm_token_weight:
        expected = local_reference_steps(problem, steps) if local else problem.steps()
    try:
        return prm_example(tokenizer, problem.text, steps, labels, results, local_step_labels(problem, steps),
                           expected, args.prm_recipe, carry_errors=not local,
                           operators=[op.operator for op in problem.operations],  # none past them
                           operands=[op.operand for op in problem.operations])
    except ValueError:  # a sample whose text does not survive rendering and re-tokenizing
        return None


def verdict_targets(problem: Problem, steps: list[str], kind: str) -> tuple[list[bool], list[int | None]]:
    """Per step, the verdict the PRM learns and the value the result head learns.
    `local`: is the step right given what the step before it wrote, and the value its own equation
    gives (PRM800K's sense of a step's correctness; a solution is right when every step is, so
    search aggregates step scores by their minimum or product, or prunes step by step as beam search
    does). `process`: is the solution right so far (Math-Shepherd's sense: the first error taints
    every later step), and the reference's value up to the first error."""
    if kind == "local":
        return local_step_labels(problem, steps), local_step_results(problem, steps)
    labels, reference = step_labels(problem, steps), problem.values() + [problem.answer]
    return labels, [reference[k] if k < len(reference) and all(labels[:k]) else None for k in range(len(steps))]


def corrupt(problem: Problem, rng: random.Random, args, shares: bool = True) -> list[str]:
    """The reference steps up to one made wrong: with `--prm-slips all`, a planted slip of a kind
    drawn evenly from those the problem admits (tasks/slips.py); with `classic`, a wrong result or
    (`--prm-operation-share` of the time, with `shares`) a wrong operator (`corrupted_steps`)."""
    if args.prm_slips == "all":
        kinds = [k for k in KINDS if len(problem.operations) > 1 or k not in ("skipped", "repeated", "too_few")]
        return plant(problem, rng.choice(kinds), rng)[0]
    if not shares:
        return corrupted_steps(problem, rng)
    return corrupted_steps(problem, rng, args.prm_operation_share, args.prm_digit_share)


def validation_problems(count: int, seed: int, whole: bool) -> list[Problem]:
    """Validation problems of the curriculum's levels, or with `whole` of every grid cell in turn."""
    if not whole:
        return generate("validation", count, seed=seed)
    cells = [(n, ops) for ops in GRID_OPERATORS for n in range(1, GRID_MAX_OPERATIONS + 1)]
    per_cell = -(-count // len(cells))
    problems = [p for n, ops in cells for p in grid_problems("validation", n, ops, per_cell, seed)]
    return random.Random(seed).sample(problems, count)


def reference_batches(tokenizer, args):
    """`next_batch` for the PRM's first stage: fresh reference solutions, half of them cut after a
    corrupted step. Their labels are clean (a wrong step is wrong in itself, nothing after it), so
    the model first learns to compare the written value with the one it computes; the generator's
    samples, where most wrong steps only inherit an earlier error, come after."""
    rng = random.Random(f"prm-references:{args.seed}")

    def next_batch(step: int):
        solutions = [(p, corrupt(p, rng, args) if rng.random() < 0.5 else p.steps())
                     for p in one_level_batch(rng, args.batch_size, args.whole)]
        return collate([labelled_example(tokenizer, p, steps, args) for p, steps in solutions], tokenizer.pad_token_id)

    return next_batch


def adapt_to_prm_format(tokenizer, model, args) -> None:
    """Language-model training on reference solutions rendered as the PRM reads them: with a recipe
    other than the generator's own format (RLHFlow's user turns), the language model computes less
    reliably than where it learnt, and a verifier must first compute what it checks."""
    rng = random.Random(f"prm-adapt:{args.seed}")

    def next_batch(step: int):
        rows = [prm_reading_example(tokenizer, p.text, p.steps(), args.prm_recipe)
                for p in one_level_batch(rng, args.batch_size, args.whole)]
        return collate(rows, tokenizer.pad_token_id)

    train(model, next_batch, lm_loss, Schedule(args.prm_adapt_steps, args.batch_size, lr=args.prm_lr, warmup=20),
          log=log, autocast=args.autocast)


def train_prm(tokenizer, base_path: Path, examples, args) -> Path:
    import transformers

    # eager attention: on CPU, PyTorch's fused attention backward takes 40% of a step at these sizes,
    # and a step with plain matmuls costs 0.57 s against 0.95 s (64 sequences of 80-170 tokens)
    base = transformers.LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32, attn_implementation="eager")
    model = grow(base, args.prm_extra_layers, args.seed + 1)
    log(f"prm: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{model.config._attn_implementation} attention")
    add_training_heads(model, base.config.num_hidden_layers + args.prm_result_layer,
                       base.config.num_hidden_layers + args.prm_result_layer + 1,
                       base.config.num_hidden_layers + args.prm_operator_layer, operand=args.prm_operand_weight > 0)
    if args.prm_adapt_steps:
        adapt_to_prm_format(tokenizer, model, args)
    good_id, bad_id = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("+", "-"))
    rng = random.Random(f"prm:{args.seed}")

    by_length = sorted(examples, key=lambda e: len(e[0]))

    def next_batch(step: int):  # neighbours in length, so little compute goes to padding
        start = rng.randrange(len(by_length) - args.batch_size + 1)
        return collate(by_length[start:start + args.batch_size], tokenizer.pad_token_id)

    weights = PRMLossWeights(lm=args.prm_lm_weight, token_verdicts=args.prm_token_weight, bad=args.prm_bad_weight,
                             result=args.prm_result_weight, local=args.prm_local_weight,
                             operator=args.prm_operator_weight, operand=args.prm_operand_weight)

    def loss_fn(model, *batch):
        return prm_loss(model, *batch, good_id=good_id, bad_id=bad_id, weights=weights)

    if args.prm_reference_steps:
        log(f"prm stage 1: {args.prm_reference_steps} steps on reference and corrupted solutions")
        train(model, reference_batches(tokenizer, args), loss_fn,
              Schedule(args.prm_reference_steps, args.batch_size, lr=args.prm_lr), log=log, autocast=args.autocast)
    log(f"prm stage 2: {args.prm_steps} steps on the generator's samples (and references)")
    train(model, next_batch, loss_fn, Schedule(args.prm_steps, args.batch_size, lr=args.prm_sample_lr), log=log,
          autocast=args.autocast)
    drop_training_heads(model)  # training aids: the checkpoint is a plain LlamaForCausalLM
    model.config.prm_recipe = args.prm_recipe  # read by treeserve wherever no recipe is given
    # a local verdict says nothing of earlier steps: a solution scores as its weakest step
    model.config.prm_aggregation = "min" if args.prm_labels == "local" else "last"
    return save(model, tokenizer, args.out / "arith-prm")


def greedy_accuracy(gen_path: Path, count: int = 200, whole: bool = False) -> dict:
    problems = validation_problems(count, 0, whole)
    solutions = sample_solutions(gen_path, problems, SamplingParams(temperature=0.0, max_tokens=256))
    by_level: dict[int, list[bool]] = {}
    for problem, [steps] in zip(problems, solutions):
        key = len(problem.operations) if whole else problem.level  # whole format: by operation count
        by_level.setdefault(key, []).append(steps == problem.steps())
    overall = [ok for oks in by_level.values() for ok in oks]
    return {"overall": sum(overall) / len(overall), **{str(k): sum(v) / len(v) for k, v in sorted(by_level.items())}}


def prm_auc(gen_path: Path, prm_path: Path, count: int, seed: int, labels: str, whole: bool = False) -> dict[str, float]:
    """AUC of the PRM's step scores, right against wrong steps (by `labels`, see `verdict_targets`),
    over the generator's own samples (temperature 0.8, as search draws them) on validation
    problems: pooled over all steps, and between siblings only (same problem, same step number),
    the comparison beam search makes; and of whole solutions by their lowest step score, right
    against wrong answers to the same problem, the comparison best-of-N makes. The pooled figure
    flatters: later steps are more often wrong, so position alone earns some of it."""
    from treeserve.runtime.runtime import Runtime

    problems = validation_problems(count, seed, whole)
    solutions = sample_solutions(gen_path, problems, SamplingParams(n=4, temperature=0.8, max_tokens=256, seed=seed))
    items = [(p, steps) for p, sampled in zip(problems, solutions) for steps in sampled if steps]
    rt = Runtime({"prm": str(prm_path)}, dtype="float32", device="cpu", kv_cache_memory_bytes=128 << 20)
    scores = rt.score_many("prm", [(p.text, steps) for p, steps in items])
    by_key: dict[tuple, tuple[list[float], list[float]]] = {}
    by_problem: dict[str, tuple[list[float], list[float]]] = {}
    for (problem, steps), step_scores in zip(items, scores):
        for index, (label, score) in enumerate(zip(verdict_targets(problem, steps, labels)[0], step_scores)):
            by_key.setdefault((problem.text, index), ([], []))[0 if label else 1].append(score)
        right = steps == problem.steps()
        by_problem.setdefault(problem.text, ([], []))[0 if right else 1].append(min(step_scores, default=0.0))
    pooled = ([s for good, _ in by_key.values() for s in good], [s for _, bad in by_key.values() for s in bad])
    return {"pooled": _auc([pooled]), "siblings": _auc(list(by_key.values())),
            "solutions_by_min": _auc(list(by_problem.values()))}


def _auc(groups: list[tuple[list[float], list[float]]]) -> float:
    wins = sum((g > b) + 0.5 * (g == b) for good, bad in groups for g in good for b in bad)
    pairs = sum(len(good) * len(bad) for good, bad in groups)
    return wins / pairs if pairs else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where arith-gen/ and arith-prm/ are written")
    parser.add_argument("--work", type=Path, default=Path("runs/arith-train"),
                        help="intermediate checkpoints and the fully trained language model (the PRM's base)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lm-steps", type=int, default=2400)
    parser.add_argument("--gen-step", type=int, default=None,
                        help="the language model's step saved as the generator (default: its last; the "
                             "levels-format pair used 1500)")
    parser.add_argument("--gen-lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=300, help="checkpoint and greedy accuracy every N steps")
    parser.add_argument("--prm-reference-steps", type=int, default=800,
                        help="first stage: steps on fresh reference and corrupted solutions (clean labels)")
    parser.add_argument("--prm-operation-share", type=float, default=0.5,
                        help="first stage: share of corrupted steps that copy the question's operand with "
                             "another operator (and apply it rightly) instead of getting the result wrong")
    parser.add_argument("--prm-digit-share", type=float, default=0.0,
                        help="first stage: share of corrupted results that get one digit replaced by another "
                             "instead of a small amount added (the generator's slips are mostly a wrong tens "
                             "digit of a product)")
    parser.add_argument("--prm-steps", type=int, default=1800,
                        help="second stage: steps on the generator's labelled samples and references")
    parser.add_argument("--prm-labels", choices=["local", "process"], default="local",
                        help="what a verdict says: local, the step is right given the step before it; "
                             "process, the solution is right so far (see verdict_targets)")
    parser.add_argument("--prm-lr", type=float, default=2e-3, help="first stage's peak learning rate")
    parser.add_argument("--prm-sample-lr", type=float, default=5e-4,
                        help="second stage's peak learning rate: lower, so the new data refines what the "
                             "first stage learnt instead of overwriting it")
    parser.add_argument("--prm-lm-weight", type=float, default=0.5)
    parser.add_argument("--prm-bad-weight", type=float, default=1.0,
                        help="weight of a wrong token's verdict against a right one's (wrong ones are rare)")
    parser.add_argument("--prm-extra-layers", type=int, default=PRM_EXTRA_LAYERS,
                        help="layers added on top of the language model: the first computes the value a "
                             "step must reach, the next compares it with the written one, the last "
                             "carries an earlier error to later verdicts")
    parser.add_argument("--prm-result-layer", type=int, default=1,
                        help="the result head reads the hidden state after this many added layers")
    parser.add_argument("--prm-result-weight", type=float, default=1.0,
                        help="weight of the training-only result head's loss (0: verdicts alone)")
    parser.add_argument("--prm-operator-weight", type=float, default=1.0,
                        help="weight of the training-only head that reads the operator the question "
                             "gives each step (the generator's wrong copies keep the operand and change "
                             "the operator)")
    parser.add_argument("--prm-operand-weight", type=float, default=0.0,
                        help="weight of a training-only head that reads the operand the question gives each "
                             "step, beside the operator head (0: no such head, the earlier pair's recipe)")
    parser.add_argument("--prm-operator-layer", type=int, default=0,
                        help="the operator head reads the hidden state after this many added layers (0: "
                             "the language model's top layer, below the result head)")
    parser.add_argument("--prm-local-weight", type=float, default=1.0,
                        help="weight of the training-only head that reads whether a step itself is right, "
                             "one layer above the result head")
    parser.add_argument("--prm-token-weight", type=float, default=0.0,
                        help="weight of the verdicts at every token of a step (right so far; with "
                             "local labels, the step itself right so far)")
    parser.add_argument("--prm-recipe", default="chat-steps", choices=sorted(RECIPES),
                        help="how the PRM reads a solution (written into its config.json)")
    parser.add_argument("--prm-adapt-steps", type=int, default=0,
                        help="language-model steps on the PRM's input format before verdict training "
                             "(useful with a recipe other than chat-steps)")
    parser.add_argument("--prm-problems", type=int, default=4000)
    parser.add_argument("--prm-samples", type=int, default=4)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--stages", default="lm,verifier",
                        help="comma-separated: lm (the generator), verifier (the bundled PRM: a language model "
                             "read by its likelihood), prm (a PRM with trained verdicts, the levels-format "
                             "pair's; it writes arith-prm too), router (the tool router, builtin:arith-router)")
    parser.add_argument("--verifier-steps", type=int, default=3600,
                        help="the verifier's training steps (more than the generator's: it must be sure "
                             "where the generator slips)")
    parser.add_argument("--router-steps", type=int, default=2800, help="the tool router's training steps")
    parser.add_argument("--router-layers", type=int, default=6,
                        help="the tool router's layers (the generator's width)")
    parser.add_argument("--router-batch-size", type=int, default=32,
                        help="the tool router's batch (one set of tools a batch: its 430-700-token system prompt runs once)")
    parser.add_argument("--format", choices=FORMATS, default="whole",
                        help="problems to train and validate on: the whole format (1-8 operations of any mix of "
                             "+ - *, starts 0-99, operands 1-9: the bundled pair), or the curriculum's levels "
                             "(2-6 operations; the earlier pair)")
    parser.add_argument("--prm-slips", choices=["classic", "all"], default="classic",
                        help="the corrupted references' slips: a wrong result or operator (classic), or every "
                             "kind of tasks/slips.py in equal shares (all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--autocast", choices=["auto", "bfloat16", "none"], default="auto",
                        help="forward passes in bfloat16 (weights stay float32); auto: where the CPU has "
                             "AMX or AVX512-BF16, which run bf16 matmuls ~3x faster than float32")
    args = parser.parse_args(argv)
    args.autocast = training_autocast(args.autocast)
    args.whole = args.format == "whole"
    args.gen_step = args.lm_steps if args.gen_step is None else args.gen_step
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    start = time.perf_counter()
    tokenizer = train_task_tokenizer(seed=args.seed)
    stages = args.stages.split(",")
    if "lm" in stages:
        gen_path, final_path = train_language_model(tokenizer, args)
    else:
        gen_path, final_path = args.out / "arith-gen", args.work / "lm-final"
    report = {"seed": args.seed, "autocast": str(args.autocast)}
    if {"lm", "prm", "verifier"} & set(stages):
        report["generator_greedy_validation"] = greedy_accuracy(gen_path, args.eval_problems, args.whole)
        log(f"generator greedy accuracy on {args.eval_problems} validation problems: "
            f"{report['generator_greedy_validation']}")
    if "prm" in stages:
        prm_path = train_prm(tokenizer, final_path, prm_dataset(tokenizer, gen_path, args), args)
        report["prm_auc_validation_samples"] = prm_auc(gen_path, prm_path, args.eval_problems, args.seed, args.prm_labels,
                                                      args.whole)
        log(f"PRM AUC on the generator's validation samples: {report['prm_auc_validation_samples']}")
    if "verifier" in stages:
        prm_path = train_verifier(tokenizer, args)
        report["verifier_auc_validation_samples"] = prm_auc(gen_path, prm_path, args.eval_problems, args.seed, "local",
                                                            args.whole)
        log(f"verifier AUC on the generator's validation samples: {report['verifier_auc_validation_samples']}")
    if "router" in stages:
        router_path = train_router(args)
        report["router_exact_calls_validation"] = router_accuracy(router_path, args.eval_problems, args.seed)
        log(f"router: exact calls on {args.eval_problems} fresh messages: {report['router_exact_calls_validation']}")
    report["seconds"] = round(time.perf_counter() - start)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"done in {report['seconds']} s: {json.dumps(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
