"""A synthetic multi-step task: a chain of small operations evaluated left to right.

`Compute 47 + 8 - 5 * 2, working from left to right.` is solved in Search-and-Learn's format,
one operation per `## Step k:` step, steps separated by a blank line, ending with a boxed answer.
Every intermediate value stays in 0..99 and each step is a small fact (a one- or two-digit number
plus, minus or times a small operand), so a tiny model can learn it while long chains stay hard.

Problems are deterministic from a seed. The split a problem belongs to is a hash of its text, so
the train, validation and test splits are disjoint by construction whatever seed draws them.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

SPLITS = {"train": (0, 90), "validation": (90, 95), "test": (95, 100)}  # ranges of hash % 100
LEVELS = (1, 2, 3, 4, 5)
MAX_VALUE = 99
FINAL_STEP = "Therefore, the final answer is: $\\boxed{{{answer}}}$."
STEP_RE = re.compile(r"^## Step (\d+): (\d+) ([-+*]) (\d+) = (\d+)$")


@dataclass(frozen=True)
class Level:
    num_operations: int
    operators: str
    max_operand: int


LEVEL_SPECS = {
    1: Level(2, "+-", 9),
    2: Level(3, "+-", 9),
    3: Level(4, "+-*", 9),
    4: Level(5, "+-*", 19),
    5: Level(6, "+-*", 29),
}


@dataclass(frozen=True)
class Operation:
    operator: str
    operand: int

    def apply(self, value: int) -> int:
        if self.operator == "+":
            return value + self.operand
        if self.operator == "-":
            return value - self.operand
        return value * self.operand


@dataclass(frozen=True)
class Problem:
    start: int
    operations: tuple[Operation, ...]
    level: int

    @property
    def text(self) -> str:
        chain = " ".join(f"{op.operator} {op.operand}" for op in self.operations)
        return f"Compute {self.start} {chain}, working from left to right."

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
        for k, (op, result) in enumerate(zip(self.operations, self.values()), start=1):
            lines.append(f"## Step {k}: {value} {op.operator} {op.operand} = {result}")
            value = result
        return lines + [FINAL_STEP.format(answer=self.answer)]

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


def split_of(text: str) -> str:
    bucket = int(_digest(text)[:8], 16) % 100
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def random_problem(rng: random.Random, level: int) -> Problem:
    spec = LEVEL_SPECS[level]
    start = rng.randint(2, MAX_VALUE)
    value, operations = start, []
    for _ in range(spec.num_operations):
        op = _random_operation(rng, value, spec)
        operations.append(op)
        value = op.apply(value)
    return Problem(start, tuple(operations), level)


def _random_operation(rng: random.Random, value: int, spec: Level) -> Operation:
    """An operation whose result stays in 0..MAX_VALUE (one always exists: + or - a small number)."""
    while True:
        operator = rng.choice(spec.operators)
        if operator == "*":
            operand = rng.randint(2, 5)
        else:
            operand = rng.randint(1, spec.max_operand)
        result = Operation(operator, operand).apply(value)
        if 0 <= result <= MAX_VALUE and not (operator == "*" and value < 2):
            return Operation(operator, operand)


def generate(split: str, n: int, seed: int, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    """`n` distinct problems of `split`, levels cycling through `levels`, deterministic from `seed`."""
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {', '.join(SPLITS)}, got {split!r}")
    if any(level not in LEVEL_SPECS for level in levels):
        raise ValueError(f"levels: must be among {LEVELS}, got {levels}")
    rng = random.Random(f"{split}:{seed}")
    problems, seen = [], set()
    while len(problems) < n:
        problem = random_problem(rng, levels[len(problems) % len(levels)])
        if problem.split == split and problem.text not in seen:
            seen.add(problem.text)
            problems.append(problem)
    return problems


def parse_problem(text: str) -> Problem:
    """The problem a `Problem.text` describes (used to check steps of a question given as text)."""
    match = re.fullmatch(r"Compute (\d+) ((?:[-+*] \d+ ?)+), working from left to right\.", text.strip())
    if not match:
        raise ValueError(f"problem: not an arithmetic-chain problem: {text!r}")
    tokens = match.group(2).split()
    operations = tuple(Operation(tokens[i], int(tokens[i + 1])) for i in range(0, len(tokens), 2))
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


def corrupted_steps(problem: Problem, rng: random.Random) -> list[str]:
    """The reference steps up to one whose result (or the final answer) is off by a small amount."""
    steps = problem.steps()
    index = rng.randrange(len(steps))
    delta = rng.choice([-10, -2, -1, 1, 2, 10])
    if index == len(steps) - 1:
        steps[index] = FINAL_STEP.format(answer=problem.answer + delta)
    else:
        head, _, result = steps[index].rpartition(" = ")
        steps[index] = f"{head} = {int(result) + delta}"
    return steps[: index + 1]


def step_labels(problem: Problem, steps: list[str]) -> list[bool]:
    """Process labels: step k is good when steps 1..k are all right (the first error taints the rest)."""
    good = correct_prefix_length(problem, steps)
    return [index < good for index in range(len(steps))]
