"""Planted slips of every kind (tasks/slips.py) on grid problems (the whole format): each slipped
step is wrong by the grader's own reference, every step before it right, and the kinds differ."""
import random

import pytest

from treeserve.errors import ParamError
from treeserve.tasks.arithmetic import (GRID_OPERATORS, correct_prefix_length, grid_cell_count, grid_problems,
                                        parse_problem)
from treeserve.tasks.slips import KINDS, plant


@pytest.mark.parametrize("kind", KINDS)
def test_each_slip_is_wrong_exactly_at_its_step(kind):
    rng = random.Random(kind)
    for operators in GRID_OPERATORS:
        for problem in grid_problems("test", 5, operators, 20, seed=1):
            steps, index = plant(problem, kind, rng)
            assert index == len(steps) - 1
            assert correct_prefix_length(problem, steps) == index, (problem.text, steps)
            assert steps[:index] == problem.steps()[:index]


def test_the_kinds_slip_as_named():
    problem = parse_problem("Start with 5 and work modulo 100. Step 1: * 9. Step 2: - 3. Step 3: + 4. What is the result?")
    rng = random.Random(0)
    steps, index = plant(problem, "too_few", rng)
    assert steps[-1] == "Therefore, the final answer is: $\\boxed{42}$." and index == 2
    steps, _ = plant(problem, "too_many", rng)
    assert steps[-1].startswith("## Step 4: ") and len(steps) == 4
    steps, index = plant(problem, "repeated", rng)
    assert steps[index].split(",")[0] == steps[index - 1].split(",")[0]
    steps, index = plant(problem, "operator", rng)
    assert steps[index].split(",")[0][-1] == problem.steps()[index].split(",")[0][-1]  # the operand kept
    steps, index = plant(problem, "truncated", rng)
    assert problem.steps()[index].startswith(steps[index]) and steps[index] != problem.steps()[index]
    with pytest.raises(ParamError, match="unknown slip"):
        plant(problem, "nonsense", rng)


def test_grid_problems_cover_the_whole_format():
    cells = [grid_problems("test", count, ops, 40, 0) for ops in GRID_OPERATORS for count in range(1, 9)]
    assert all(len({p.text for p in cell}) == 40 for cell in cells)  # distinct within a cell
    problems = [p for cell in cells for p in cell]
    assert {p.start for p in problems} >= {0, 99} and {len(p.operations) for p in problems} == set(range(1, 9))
    assert {op.operand for p in problems for op in p.operations} == set(range(1, 10))
    assert all(p.split == "test" for p in problems)
    assert {op.operator for p in grid_problems("test", 8, "*", 40, 0) for op in p.operations} == {"*"}
    with pytest.raises(ParamError):
        grid_problems("test", 9, "+", 1, 0)


def test_a_grid_cell_short_of_problems_is_refused():
    assert grid_cell_count("test", 1, "*") == 41  # 900 problems in all, 5% of hashes are the test split's
    assert len(grid_problems("test", 1, "*", 41, 0)) == 41
    with pytest.raises(ParamError, match="has 41 distinct problems of 1 operation"):
        grid_problems("test", 1, "*", 42, 0)  # once an endless search for a 42nd
    assert grid_cell_count("test", 3, "+-") is None  # 583,200 in all: never short
