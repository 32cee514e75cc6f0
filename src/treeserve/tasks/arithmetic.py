"""A synthetic multi-step task: numbered operations applied in order to a starting number, modulo 100.

`Start with 38 and work modulo 100. Step 1: * 7. Step 2: + 9. Step 3: - 4. What is the result?` is
solved in Search-and-Learn's format, one operation per step (`## Step 1: * 7, 38 * 7 = 66`), steps
separated by a blank line, ending with a boxed answer. A solution step opens with the words of its
operation in the question, so finding the operation is a copy. Every number has one or two digits
and every operand one, so each step is a small fact (a sum, difference or product, with its carry
or borrow); the difficulty is getting every fact of a longer chain right.

Problems are deterministic from a seed. The split a problem belongs to is a hash of its text, so
the train, validation and test splits are disjoint by construction whatever seed draws them.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import random
import re
from dataclasses import dataclass

from treeserve.errors import ParamError

SPLITS = {"train": (0, 90), "validation": (90, 95), "test": (95, 100)}  # ranges of hash % 100
LEVELS = (1, 2, 3, 4, 5)
FINAL_STEP = "Therefore, the final answer is: $\\boxed{{{answer}}}$."


MODULUS = 100


@dataclass(frozen=True)
class Level:
    num_operations: int
    operators: str
    max_operand: int      # for + and -
    max_multiplier: int   # for *


LEVEL_SPECS = {
    1: Level(2, "+-", 9, 0),
    2: Level(3, "+-*", 9, 5),
    3: Level(4, "+-*", 9, 9),
    4: Level(5, "+-*", 9, 9),
    5: Level(6, "+-*", 9, 9),
}


@dataclass(frozen=True)
class Operation:
    operator: str
    operand: int

    def apply(self, value: int) -> int:
        if self.operator == "+":
            return (value + self.operand) % MODULUS
        if self.operator == "-":
            return (value - self.operand) % MODULUS
        return (value * self.operand) % MODULUS


@dataclass(frozen=True)
class Problem:
    start: int
    operations: tuple[Operation, ...]
    level: int

    @property
    def text(self) -> str:
        chain = " ".join(f"Step {k}: {op.operator} {op.operand}." for k, op in enumerate(self.operations, start=1))
        return f"Start with {self.start} and work modulo {MODULUS}. {chain} What is the result?"

    def values(self) -> list[int]:
        """The running value after each operation."""
        values, value = [], self.start
        for op in self.operations:
            value = op.apply(value)
            values.append(value)
        return values

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def steps(self) -> list[str]:
        lines, value = [], self.start
        for index in range(len(self.operations)):
            lines.append(self.step_from(index, value))
            value = self.operations[index].apply(value)
        return lines + [FINAL_STEP.format(answer=self.answer)]

    def step_from(self, index: int, value: int) -> str:
        """Step `index` (0-based) as the reference writes it when the running value is `value`;
        one past the last operation, the final answer."""
        if index == len(self.operations):
            return FINAL_STEP.format(answer=value)
        return format_step(index + 1, self.operations[index], value)

    @property
    def solution(self) -> str:
        return "\n\n".join(self.steps())

    @property
    def split(self) -> str:
        return split_of(self.text)

    def row(self) -> dict:
        """A JSONL row with MATH-500's field names."""
        return {"problem": self.text, "solution": self.solution, "answer": str(self.answer),
                "level": self.level, "unique_id": f"arith/{self.split}/{_digest(self.text)[:12]}"}


def format_step(number: int, op: Operation, value: int) -> str:
    return f"## Step {number}: {op.operator} {op.operand}, {value} {op.operator} {op.operand} = {op.apply(value)}"


def split_of(text: str) -> str:
    bucket = int(_digest(text)[:8], 16) % 100
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def random_problem(rng: random.Random, level: int) -> Problem:
    spec = LEVEL_SPECS[level]
    start = rng.randint(2, MODULUS - 1)
    return Problem(start, tuple(_random_operation(rng, spec) for _ in range(spec.num_operations)), level)


def _random_operation(rng: random.Random, spec: Level) -> Operation:
    operator = rng.choice(spec.operators)
    if operator == "*":
        return Operation(operator, rng.randint(2, spec.max_multiplier))
    return Operation(operator, rng.randint(1, spec.max_operand))


# Draws without a new problem, per problem the level can make, before a level counts as used up
MISSES_PER_PROBLEM = 20


def level_size(level: int) -> int:
    """How many problems of a level there are in all splits: its starts times its operations' choices."""
    spec = LEVEL_SPECS[level]
    choices = spec.max_operand * (("+" in spec.operators) + ("-" in spec.operators)) \
        + (spec.max_multiplier - 1 if "*" in spec.operators else 0)
    return (MODULUS - 2) * choices ** spec.num_operations


def generate(split: str, n: int, seed: int, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    """`n` distinct problems of `split`, levels cycling through `levels`, deterministic from `seed`."""
    if split not in SPLITS:
        raise ParamError("split", f"must be one of {', '.join(SPLITS)}, got {split!r}")
    if any(level not in LEVEL_SPECS for level in levels):
        raise ParamError("levels", f"must be among {LEVELS}, got {levels}")
    rng = random.Random(f"{split}:{seed}")
    problems, seen, misses = [], set(), 0
    while len(problems) < n:
        level = levels[len(problems) % len(levels)]
        problem = random_problem(rng, level)
        if problem.split == split and problem.text not in seen:
            seen.add(problem.text)
            problems.append(problem)
            misses = 0
            continue
        misses += 1
        if misses > MISSES_PER_PROBLEM * level_size(level):  # (it would draw forever)
            found = sum(p.level == level for p in problems)
            raise ParamError("n", f"level {level} has {found} distinct {split} problems (a start and "
                             f"{LEVEL_SPECS[level].num_operations} operations can be written only so many ways), "
                             f"and {n} problems cycling through levels {list(levels)} need more; ask for fewer")
    return problems


GRID_OPERATORS = ("+-", "*", "+-*")  # the operator sets of the evaluation grid (issue #39)
GRID_MAX_OPERATIONS = 8


def grid_problems(split: str, num_operations: int, operators: str, n: int, seed: int) -> list[Problem]:
    """`n` distinct problems of the whole format: a start of 0-99 and `num_operations` operations
    drawn from `operators`, every operand 1-9 (level 0: outside the curriculum's levels)."""
    if split not in SPLITS:
        raise ParamError("split", f"must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 1 <= num_operations <= GRID_MAX_OPERATIONS or not operators or set(operators) - set("+-*"):
        raise ParamError("grid", f"1-{GRID_MAX_OPERATIONS} operations of + - *, got {num_operations} of {operators!r}")
    available = grid_cell_count(split, num_operations, operators)
    if available is not None and n > available:
        raise ParamError("n", f"the {split} split has {available} distinct problems of {num_operations} "
                              f"operation(s) of {operators!r}; asked for {n}")
    rng = random.Random(f"grid:{split}:{num_operations}:{operators}:{seed}")
    problems, seen = [], set()
    while len(problems) < n:
        problem = random_grid_problem(rng, num_operations, operators)
        if problem.split == split and problem.text not in seen:
            seen.add(problem.text)
            problems.append(problem)
    return problems


@functools.lru_cache(maxsize=None)
def grid_cell_count(split: str, num_operations: int, operators: str, limit: int = 100_000) -> int | None:
    """How many distinct problems of `split` a grid cell holds (a split is a share of the hashes, so
    small cells run out: one operation of `+ -` has 99 test problems, of `*` 41); None where the cell has more
    than `limit` problems in all (never short of problems)."""
    choices = [Operation(op, operand) for op in sorted(set(operators)) for operand in range(1, 10)]
    if MODULUS * len(choices) ** num_operations > limit:
        return None
    return sum(Problem(start, ops, 0).split == split for start in range(MODULUS)
               for ops in itertools.product(choices, repeat=num_operations))


def random_grid_problem(rng: random.Random, num_operations: int, operators: str) -> Problem:
    """One problem of the whole format (any split): a start of 0-99, operands 1-9."""
    ops = tuple(Operation(rng.choice(operators), rng.randint(1, 9)) for _ in range(num_operations))
    return Problem(rng.randint(0, MODULUS - 1), ops, 0)


def parse_problem(text: str) -> Problem:
    """The problem a `Problem.text` describes (used to check steps of a question given as text)."""
    match = re.fullmatch(rf"Start with (\d+) and work modulo {MODULUS}\. (.+)\. What is the result\?", text.strip())
    parts = [re.fullmatch(r"Step (\d+): ([-+*]) (\d+)", part) for part in match.group(2).split(". ")] if match else [None]
    if not match or not all(parts) or [int(p.group(1)) for p in parts] != list(range(1, len(parts) + 1)):
        raise ParamError("problem", f"not an arithmetic-chain problem: {text!r}")
    operations = tuple(Operation(p.group(2), int(p.group(3))) for p in parts)
    level = next((lvl for lvl, spec in LEVEL_SPECS.items() if spec.num_operations == len(operations)), 0)
    return Problem(int(match.group(1)), operations, level)


def correct_prefix_length(problem: Problem, steps: list[str]) -> int:
    """How many leading steps are exactly right (operands, operator, result, and the final answer)."""
    expected = problem.steps()
    count = 0
    for step, want in zip(steps, expected):
        if step.strip() != want:
            break
        count += 1
    return count


def corrupted_steps(problem: Problem, rng: random.Random, operation_share: float = 0.0,
                    digit_share: float = 0.0) -> list[str]:
    """The reference steps up to one whose result (or the final answer) is off by a small amount;
    with probability `operation_share`, an operation step instead applies, rightly, the question's
    operand with another operator (the generator's second most common slip: of its 208 wrong copies
    in 800 samples of 200 validation problems, 206 kept the operand and changed the operator); with
    probability `digit_share`, a wrong result has one digit replaced by another instead (the
    generator's result slips: of 8,701 in its training samples, 5,189 are a wrong tens digit, 4,589
    of them in a product)."""
    steps = problem.steps()
    index = rng.randrange(len(steps))
    delta = rng.choice([-10, -2, -1, 1, 2, 10])
    if operation_share and index < len(problem.operations) and rng.random() < operation_share:
        value = problem.values()[index - 1] if index else problem.start
        steps[index] = format_step(index + 1, _other_operation(problem.operations[index], rng), value)
        return steps[: index + 1]
    if index == len(steps) - 1:
        steps[index] = FINAL_STEP.format(answer=(problem.answer + delta) % MODULUS)
    else:
        head, _, result = steps[index].rpartition(" = ")
        wrong = _slipped_digit(int(result), rng) if digit_share and rng.random() < digit_share else int(result) + delta
        steps[index] = f"{head} = {wrong % MODULUS}"
    return steps[: index + 1]


def _slipped_digit(value: int, rng: random.Random) -> int:
    """`value` (below 100) with its tens or its units digit, equally likely, replaced by another."""
    tens, units = divmod(value, 10)
    if rng.random() < 0.5:
        return rng.choice([d for d in range(10) if d != tens]) * 10 + units
    return tens * 10 + rng.choice([d for d in range(10) if d != units])


def _other_operation(op: Operation, rng: random.Random) -> Operation:
    return Operation(rng.choice([operator for operator in "+-*" if operator != op.operator]), op.operand)


def local_step_labels(problem: Problem, steps: list[str]) -> list[bool]:
    """Step k is locally right when it is exactly what the reference writes from the value step k-1
    wrote (the start for step 1): it made no mistake of its own, whatever came before it."""
    return [step.strip() == want != "" for step, want in zip(steps, local_reference_steps(problem, steps))]


def local_step_results(problem: Problem, steps: list[str]) -> list[int | None]:
    """The value each step's own equation gives (`v op b` as written, worked modulo 100), whether
    or not it copied the right operation and value: what a solver computes once it has written the
    left side; for the final answer, the value the step before it wrote. None where unreadable."""
    results = []
    for index, (step, value) in enumerate(zip(steps, _values_before(problem, steps))):
        equation = re.search(r"(\d+) ([-+*]) (\d+) = \d+$", step.strip())
        if equation and int(equation.group(1)) < MODULUS:
            results.append(Operation(equation.group(2), int(equation.group(3))).apply(int(equation.group(1))))
        elif step.strip().startswith("Therefore") and value is not None and value < MODULUS:
            results.append(value)
        else:
            results.append(None)
    return results


def local_reference_steps(problem: Problem, steps: list[str]) -> list[str]:
    """Per step, what the reference writes there from the value the step before it wrote ('' where
    that value is unreadable or the question has no such step): `local_step_labels` compares with it."""
    return [problem.step_from(index, value) if value is not None and index <= len(problem.operations) else ""
            for index, value in enumerate(_values_before(problem, steps))]


def _values_before(problem: Problem, steps: list[str]) -> list[int | None]:
    """Per step, the value written by the step before it (the start for step 1); None if unreadable."""
    values, value = [], problem.start
    for step in steps:
        values.append(value)
        written = re.search(r"= (\d+)$", step.strip())
        value = int(written.group(1)) if written else None
    return values


def step_labels(problem: Problem, steps: list[str]) -> list[bool]:
    """Process labels: step k is good when steps 1..k are all right (the first error taints the rest)."""
    good = correct_prefix_length(problem, steps)
    return [index < good for index in range(len(steps))]
