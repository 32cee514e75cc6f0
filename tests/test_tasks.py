"""The synthetic arithmetic task: determinism, disjoint splits, S&L-format solutions, step labels."""
import json
import random

import pytest

from treeserve.cli import main
from treeserve.search.grading import extract_answer, grade
from treeserve.tasks.arithmetic import (LEVEL_SPECS, MODULUS, Operation, Problem, corrupted_steps, generate,
                                        local_reference_steps, local_step_labels, local_step_results,
                                        parse_problem, split_of, step_labels)
from treeserve.tasks.tokenizer import train_task_tokenizer


def test_same_seed_same_problems_and_other_seeds_differ():
    assert [p.text for p in generate("test", 20, seed=1)] == [p.text for p in generate("test", 20, seed=1)]
    assert [p.text for p in generate("test", 20, seed=1)] != [p.text for p in generate("test", 20, seed=2)]


def test_splits_are_disjoint_whatever_the_seed():
    train = {p.text for seed in range(3) for p in generate("train", 300, seed)}
    test = {p.text for seed in range(3) for p in generate("test", 300, seed)}
    validation = {p.text for p in generate("validation", 300, 0)}
    assert not train & test and not train & validation and not test & validation
    assert all(split_of(text) == "test" for text in test)


@pytest.mark.parametrize("level", sorted(LEVEL_SPECS))
def test_solutions_follow_the_sal_format_and_reach_the_answer(level):
    for problem in generate("test", 30, seed=0, levels=(level,)):
        steps = problem.solution.split("\n\n")
        assert len(steps) == LEVEL_SPECS[level].num_operations + 1
        assert all(step.startswith(f"## Step {k}: ") for k, step in enumerate(steps[:-1], start=1))
        assert all(0 <= value < MODULUS for value in problem.values())
        assert extract_answer(problem.solution) == problem.row()["answer"] == str(problem.answer)
        assert grade(extract_answer(problem.solution), problem.row()["answer"])


def test_answer_is_the_left_to_right_value():
    problem = parse_problem("Start with 7 and work modulo 100. Step 1: * 5. Step 2: + 6. Step 3: - 14. What is the result?")
    assert problem.values() == [35, 41, 27] and problem.answer == 27 and problem.level == 2  # three operations
    assert parse_problem(problem.text) == problem
    wrapping = parse_problem("Start with 38 and work modulo 100. Step 1: * 7. Step 2: + 9. Step 3: - 84. What is the result?")
    assert wrapping.values() == [66, 75, 91] and wrapping.steps()[0] == "## Step 1: * 7, 38 * 7 = 66"
    with pytest.raises(ValueError, match="problem"):
        parse_problem("What is 2 + 2?")
    with pytest.raises(ValueError, match="problem"):  # operations out of order
        parse_problem("Start with 7 and work modulo 100. Step 2: * 5. Step 1: + 6. What is the result?")


def test_step_labels_mark_the_first_error_and_everything_after_it():
    problem = parse_problem("Start with 40 and work modulo 100. Step 1: + 5. Step 2: - 3. Step 3: * 2. What is the result?")
    good = problem.steps()
    assert step_labels(problem, good) == [True] * 4
    wrong_second = [good[0], "## Step 2: - 3, 45 - 3 = 43", "## Step 3: * 2, 43 * 2 = 86", good[3]]
    assert step_labels(problem, wrong_second) == [True, False, False, False]
    assert step_labels(problem, good[:2]) == [True, True]
    assert step_labels(problem, ["## Step 1: + 5, 40 + 5 = 45 "]) == [True]  # surrounding space is not an error


def test_rows_have_math500_fields_and_export_writes_them(tmp_path):
    out = tmp_path / "test.jsonl"
    assert main(["tasks", "export", "--split", "test", "--n", "12", "--seed", "4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12 and {r["level"] for r in rows} == set(LEVEL_SPECS)
    assert set(rows[0]) == {"problem", "solution", "answer", "level", "unique_id"}
    assert len({r["unique_id"] for r in rows}) == 12
    assert rows == [p.row() for p in generate("test", 12, seed=4)]


def test_tokenizer_round_trips_and_has_single_token_verdicts():
    tokenizer = train_task_tokenizer()
    problem: Problem = generate("train", 1, seed=0, levels=(5,))[0]
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": problem.text},
                {"role": "assistant", "content": problem.solution}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "ignored" not in text  # the bundled models were trained without a system prompt
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in ("+", "-"))
    digits = [t for t in tokenizer.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
    assert all(sum(c.isdigit() for c in t) == 1 for t in digits)  # one digit per token


def test_corrupted_steps_end_at_their_one_wrong_step():
    rng = random.Random(0)
    for problem in generate("test", 40, seed=0):
        steps = corrupted_steps(problem, rng)
        labels = step_labels(problem, steps)
        assert labels == [True] * (len(steps) - 1) + [False]
        assert extract_answer(steps[-1]) != str(problem.answer) or not steps[-1].startswith("Therefore")


def test_prm_training_labels_mark_the_first_wrong_digit_and_stop_imitation_there():
    from treeserve.tasks.training import IGNORE, prm_example

    tokenizer = train_task_tokenizer()
    problem = parse_problem("Start with 40 and work modulo 100. Step 1: + 5. Step 2: - 3. Step 3: * 2. What is the result?")
    steps = problem.steps()
    steps[1] = "## Step 2: - 3, 45 - 3 = 43"  # right is 42: the last digit is the first wrong token
    results = [45, 42, None, None]  # the reference's values through the first wrong step
    ids, verdicts, lm_labels, token_verdicts, result_targets, local_verdicts, operator_classes, operand_classes = \
        prm_example(tokenizer, problem.text, steps, step_labels(problem, steps), results,
                    local_step_labels(problem, steps), expected=problem.steps(), operators=["+", "-", "*", None],
                    operands=[5, 3, 2, None])
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert [v for v in verdicts if v != IGNORE] == [1, 0, 0, 0]
    marked = [(tokens[i].replace("Ġ", " ").replace("Ċ", "\n"), v) for i, v in enumerate(token_verdicts) if v != IGNORE]
    text_marks = "".join(t for t, _ in marked)
    assert text_marks == "".join(step + "\n\n" for step in steps)  # every token from the first step on, nothing before
    second = text_marks.index(steps[1])
    flags = [v for t, v in marked for _ in t]  # one flag per character
    wrong_digit = second + len(steps[1]) - 1
    assert set(flags[:wrong_digit]) == {1} and set(flags[wrong_digit:]) == {0}
    last_good_verdict = [i for i, v in enumerate(verdicts) if v == 1][-1]
    known = last_good_verdict + 1  # the language-model labels end with step 1's delimiter: step 2 is not imitated
    assert tokenizer.decode(ids[known - 2:known]) == "\n\n" and tokenizer.decode(ids[known:known + 1]) == "##"
    assert lm_labels[:known] == ids[:known] and set(lm_labels[known:]) == {IGNORE}
    # the values given, at their steps' verdict positions, nothing where None
    verdict_positions = [i for i, v in enumerate(verdicts) if v != IGNORE]
    assert [result_targets[i] for i in verdict_positions] == [45, 42, IGNORE, IGNORE]
    assert all(t == IGNORE for i, t in enumerate(result_targets) if i not in verdict_positions)
    # step 3 (the reference's) restates 42 where step 2 wrote 43, so it is wrong locally too; the final
    # answer repeats step 3's 84, so it is right locally
    assert [local_verdicts[i] for i in verdict_positions] == [1, 0, 0, 1]
    # the question's operators as OPERATORS' indices ("+-*"), none for the final answer
    assert [operator_classes[i] for i in verdict_positions] == [0, 1, 2, IGNORE]
    assert all(t == IGNORE for i, t in enumerate(operator_classes) if i not in verdict_positions)
    # and their operands as classes 0-8 (operand - 1)
    assert [operand_classes[i] for i in verdict_positions] == [4, 2, 1, IGNORE]
    assert all(t == IGNORE for i, t in enumerate(operand_classes) if i not in verdict_positions)


def test_corrupted_operations_are_wrong_copies_applied_rightly():
    rng = random.Random(1)
    for problem in generate("test", 40, seed=3):
        steps = corrupted_steps(problem, rng, operation_share=1.0)
        index = len(steps) - 1
        assert step_labels(problem, steps) == [True] * index + [False]
        assert local_step_labels(problem, steps)[-1] is False
        if index < len(problem.operations):  # an operation step: the header names another operator
            header, _, result = steps[-1].rpartition(" = ")
            op = problem.operations[index]
            value, operator, operand = header.split(", ")[1].split(" ")
            assert header.startswith(f"## Step {index + 1}: {operator} {op.operand},") and operator != op.operator
            assert int(operand) == op.operand and int(result) == Operation(operator, op.operand).apply(int(value))


def test_corrupted_digits_replace_one_digit_of_a_result():
    rng = random.Random(2)
    for problem in generate("test", 60, seed=4):
        steps = corrupted_steps(problem, rng, digit_share=1.0)
        index = len(steps) - 1
        assert local_step_labels(problem, steps)[-1] is False
        if index < len(problem.operations):
            right, wrong = problem.values()[index], int(steps[-1].rpartition(" = ")[2])
            assert wrong != right and (wrong // 10 == right // 10 or wrong % 10 == right % 10)


def test_local_labels_judge_each_step_from_the_value_written_before_it():
    problem = parse_problem("Start with 40 and work modulo 100. Step 1: + 5. Step 2: - 3. Step 3: * 2. What is the result?")
    steps = problem.steps()
    assert local_step_labels(problem, steps) == [True] * 4
    wrong = ["## Step 1: + 5, 40 + 5 = 46", "## Step 2: - 3, 46 - 3 = 43", "## Step 3: * 2, 43 * 2 = 86",
             "Therefore, the final answer is: $\\boxed{86}$."]
    assert local_step_labels(problem, wrong) == [False, True, True, True]
    assert step_labels(problem, wrong) == [False] * 4
    copied_wrong = ["## Step 1: + 5, 40 + 5 = 45", "## Step 2: - 3, 54 - 3 = 51", "garbled", "## Step 3: * 2, 1 * 2 = 2"]
    assert local_step_labels(problem, copied_wrong) == [True, False, False, False]


def test_local_results_are_what_each_written_equation_gives():
    problem = parse_problem("Start with 40 and work modulo 100. Step 1: + 5. Step 2: - 3. Step 3: * 2. What is the result?")
    assert local_step_results(problem, problem.steps()) == [45, 42, 84, 84]
    wrong = ["## Step 1: + 5, 40 + 5 = 46", "## Step 2: * 3, 46 * 3 = 44", "## Step 3: * 2, 44 * 2 = 88",
             "Therefore, the final answer is: $\\boxed{88}$."]
    # step 2 copied the wrong operation: its equation still says 46 * 3, which is 38 (not the 44 written)
    assert local_step_results(problem, wrong) == [45, 38, 88, 88]
    assert local_step_labels(problem, wrong) == [False, False, True, True]
    assert local_reference_steps(problem, wrong)[1] == "## Step 2: - 3, 46 - 3 = 43"
    unreadable = ["## Step 1: + 5, 40 + 5 = 145", "garbled", "Therefore, the final answer is: $\\boxed{1}$."]
    assert local_step_results(problem, unreadable) == [45, None, None]
    assert local_reference_steps(problem, unreadable)[2] == ""  # nothing readable before it


def test_local_token_verdicts_judge_each_step_from_the_value_written_before_it():
    from treeserve.tasks.training import IGNORE, prm_example

    tokenizer = train_task_tokenizer()
    problem = parse_problem("Start with 40 and work modulo 100. Step 1: + 5. Step 2: - 3. What is the result?")
    steps = ["## Step 1: + 5, 40 + 5 = 46", "## Step 2: - 3, 46 - 3 = 43", "Therefore, the final answer is: $\\boxed{43}$."]
    labels = local_step_labels(problem, steps)
    assert labels == [False, True, True]
    _, verdicts, _, token_verdicts, results, _, _, _ = prm_example(
        tokenizer, problem.text, steps, labels, local_step_results(problem, steps), labels,
        expected=local_reference_steps(problem, steps), carry_errors=False)
    marked = [v for v in token_verdicts if v != IGNORE]
    first_step = len(tokenizer.encode(steps[0] + "\n\n", add_special_tokens=False))
    assert 0 in marked[:first_step] and marked[0] == 1  # step 1 goes wrong at its last digit
    assert set(marked[first_step:]) == {1}  # the later steps are right from what step 1 wrote
    assert [v for v in verdicts if v != IGNORE] == [0, 1, 1]
    assert [r for r in results if r != IGNORE] == [45, 43, 43]


def test_asking_for_more_problems_than_a_level_has_is_an_error_not_a_hang():
    """Level 1 has 1,561 test problems: the 1,562nd was drawn for ever (at 100% CPU, nothing written)."""
    from treeserve.errors import ParamError
    from treeserve.tasks.arithmetic import generate

    assert len(generate("test", 1561, 0, (1,))) == 1561
    with pytest.raises(ParamError, match="level 1 has 1561 distinct test problems") as more:
        generate("test", 1562, 0, (1,))
    assert more.value.param == "n"
