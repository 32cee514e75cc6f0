"""Planted slips of every kind (tasks/slips.py) on grid problems (the whole format): each slipped
step is wrong by the grader's own reference, every step before it right, and the kinds differ."""
import random
import re

import pytest

from treeserve.errors import ParamError
from treeserve.tasks.arithmetic import (FINAL_STEP, GRID_OPERATORS, correct_prefix_length, grid_cell_count,
                                        grid_problems, parse_problem)
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
    """Every one of the nine kinds, each checked for the slip its name says (and only that slip)."""
    problem = parse_problem("Start with 5 and work modulo 100. Step 1: * 9. Step 2: - 3. Step 3: + 4. What is the result?")
    right, ops, values = problem.steps(), problem.operations, [problem.start] + problem.values()
    rng, planted = random.Random(0), set()

    def slip(kind: str) -> tuple[list[str], int]:
        planted.add(kind)
        steps, index = plant(problem, kind, rng)
        assert steps[:index] == right[:index] and len(steps) == index + 1, (kind, steps)
        return steps, index

    steps, index = slip("too_few")
    assert steps[-1] == "Therefore, the final answer is: $\\boxed{42}$." and index == 2
    steps, _ = slip("too_many")
    assert steps[-1].startswith("## Step 4: ") and len(steps) == 4
    steps, index = slip("repeated")
    assert steps[index].split(",")[0] == steps[index - 1].split(",")[0]
    steps, index = slip("operator")
    assert steps[index].split(",")[0][-1] == problem.steps()[index].split(",")[0][-1]  # the operand kept
    number, operator, operand = _operation(steps[index])  # another operator, on the right running value
    assert number == index + 1 and operator != ops[index].operator and operand == str(ops[index].operand), steps
    assert steps[index].split(", ")[1].startswith(f"{values[index]} {operator} {operand} = ")
    steps, index = slip("truncated")
    assert problem.steps()[index].startswith(steps[index]) and steps[index] != problem.steps()[index]
    steps, index = slip("operand")  # the operator kept, another digit, applied to the right running value
    number, operator, operand = _operation(steps[index])
    assert (number, operator) == (index + 1, ops[index].operator) and operand != str(ops[index].operand), steps
    assert steps[index].split(", ")[1].startswith(f"{values[index]} {operator} {operand} = ")
    steps, index = slip("skipped")  # the next step's operation, applied to this step's value
    assert steps[index].split(",")[0] == right[index + 1].split(",")[0] and index < len(ops) - 1, steps
    assert steps[index].split(", ")[1].startswith(f"{values[index]} ")
    steps, index = slip("arithmetic")  # the right step but for its result
    head, _, result = steps[index].rpartition(" = ")
    right_head, _, right_result = right[index].rpartition(" = ")
    assert head == right_head and result != right_result and 0 <= int(result) < 100, steps
    steps, index = slip("final_answer")  # every step right, then a wrong answer
    answer = re.fullmatch(re.escape(FINAL_STEP.format(answer="N")).replace("N", r"(\d+)"), steps[-1])
    assert index == len(ops) and answer and int(answer[1]) != problem.answer, steps
    assert planted == set(KINDS) and len(KINDS) == 9, sorted(set(KINDS) - planted)
    with pytest.raises(ParamError, match="unknown slip"):
        plant(problem, "nonsense", rng)


def _operation(step: str) -> tuple[int, str, str]:
    """(step number, operator, operand) of a step as the reference writes it."""
    number, operator, operand = re.match(r"## Step (\d+): ([-+*]) (\d+),", step).groups()
    return int(number), operator, operand


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
