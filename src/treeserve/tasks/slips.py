"""Planted slips: a reference solution with one step made wrong in a named way, for measuring what a
PRM catches (issue #39's kinds). `plant(problem, kind, rng)` gives the steps up to and including
the slipped one, and its index; the steps before it are the reference's, so they are right.

Kinds: the question's operator or operand copied wrong (the arithmetic then right for what was
written), a step skipped (the next question step written in its place, under its own number) or
repeated (the step before written again), the arithmetic wrong (a digit or a small amount), a
final answer that is not the last value, too many steps (an operation past the last one) or too
few (the final answer one step early), and a step cut short.
"""
from __future__ import annotations

import random

from treeserve.errors import ParamError
from treeserve.tasks.arithmetic import FINAL_STEP, MODULUS, Operation, Problem, format_step

KINDS = ("operator", "operand", "skipped", "repeated", "arithmetic", "final_answer", "too_many", "too_few",
         "truncated")


def plant(problem: Problem, kind: str, rng: random.Random) -> tuple[list[str], int]:
    """(steps ending with the slipped one, its index) for `kind` (one of KINDS)."""
    if kind not in KINDS:
        raise ParamError("kind", f"unknown slip {kind!r}; known: {', '.join(KINDS)}")
    steps, values = problem.steps(), [problem.start] + problem.values()
    n = len(problem.operations)
    if kind in ("skipped", "repeated", "too_few") and n < 2:
        raise ParamError("kind", f"a {kind!r} slip needs two operations or more")
    if kind == "final_answer":
        wrong = rng.choice([v for v in range(MODULUS) if v != problem.answer])
        return steps[:n] + [FINAL_STEP.format(answer=wrong)], n
    if kind == "too_many":
        extra = Operation(rng.choice("+-*"), rng.randint(1, 9))
        return steps[:n] + [format_step(n + 1, extra, problem.answer)], n
    if kind == "too_few":
        return steps[:n - 1] + [FINAL_STEP.format(answer=values[n - 1])], n - 1
    index = rng.randrange(1 if kind == "repeated" else 0, n - 1 if kind == "skipped" else n)
    return steps[:index] + [_slipped_step(problem, kind, index, values[index], rng)], index


def _slipped_step(problem: Problem, kind: str, index: int, value: int, rng: random.Random) -> str:
    op = problem.operations[index]
    if kind == "operator":
        return format_step(index + 1, Operation(rng.choice([o for o in "+-*" if o != op.operator]), op.operand), value)
    if kind == "operand":
        return format_step(index + 1, Operation(op.operator, rng.choice([d for d in range(1, 10) if d != op.operand])),
                           value)
    if kind == "skipped":
        return format_step(index + 2, problem.operations[index + 1], value)
    if kind == "repeated":
        return format_step(index, problem.operations[index - 1], value)
    right = format_step(index + 1, op, value)
    if kind == "truncated":
        return right[:rng.randrange(len("## Step 1:"), len(right) - 1)].rstrip()
    head, _, result = right.rpartition(" = ")
    return f"{head} = {_wrong_result(int(result), rng)}"


def _wrong_result(value: int, rng: random.Random) -> int:
    """A result off by a small amount or by one digit (the generator's usual arithmetic slips)."""
    if rng.random() < 0.5:
        return (value + rng.choice([-10, -2, -1, 1, 2, 10])) % MODULUS
    tens, units = divmod(value, 10)
    if rng.random() < 0.5:
        return rng.choice([d for d in range(10) if d != tens]) * 10 + units
    return tens * 10 + rng.choice([d for d in range(10) if d != units])
