"""Answer extraction, grading, pass@k and vote aggregation (treeserve.search.grading)."""
from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest

from treeserve.search import grading
from treeserve.search.grading import (
    canonical_form,
    extract_answer,
    grade,
    majority_vote,
    naive_best,
    pass_at_k,
    weighted_vote,
)

MATH500 = Path(__file__).resolve().parents[1] / "data" / "math500.jsonl"  # vendored (data/README.md)


# --- extraction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\frac{a^{2}}{\sqrt{b_{1}}}}", r"\frac{a^{2}}{\sqrt{b_{1}}}"),
        (r"first \boxed{1}, then \boxed{2}, finally \boxed{3}.", "3"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{1} and later \fbox{x+1}", "x+1"),
        (r"hence $\boxed 5$.", "5"),
        (r"hence \boxed 5.", "5"),
        (r"\boxed {  12 }", "12"),
        (r"\boxed{2} then a broken \boxed{", "2"),
        ("The final answer is $\\frac{3}{4}$. I hope it is correct.", r"\frac{3}{4}"),
        ("So the answer is 42.", "42"),
        ("Therefore, the final answer is: $x^2 + 1$", "x^2 + 1"),
        ("The answer is 7. Then the final answer is 8.", "8"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", ["", "no answer here", r"\boxed{never closed", r"\boxedfoo{3}", r"\boxed}"])
def test_extract_answer_none(text):
    assert extract_answer(text) is None


def test_boxed_wins_over_answer_phrase():
    assert extract_answer(r"The answer is 4. Actually \boxed{5} and the answer is 6.") == "5"


# --- grading -------------------------------------------------------------------------------------

EQUAL = [
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac12", r"\frac{1}{2}"),
    (r"\tfrac{3}{2}", "1.5"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
    (r"[1, 3)", r"[1,3)"),
    (r"(-\infty, 2] \cup [5, \infty)", r"(-\infty,2]\cup[5,\infty)"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    (r"10^\circ", "10"),
    (r"10^{\circ}", "10"),
    (r"\text{(A)}", "A"),
    ("(C)", r"\text{(C)}"),
    (r"\text{Evelyn}", "Evelyn"),
    (r"5\text{ cm}", "5"),
    (r"12 \text{ inches}^2", "12"),
    (r"\$18.90", "18.90"),
    ("50\\%", "50"),
    (r"10,\!000", "10000"),
    ("x = 5", "5"),
    ("5.", "5"),
    (r"x^2+2x+1", r"(x+1)^2"),
    (r"\pi/3", r"\frac{\pi}{3}"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"$\frac{-1}{2}$", r"-\frac12"),
    (r"-\frac{-2}{4}", "0.5"),
    (r"\frac{6}{4}", r"\frac32"),
    ("0.333333", r"\frac13"),
]

NOT_EQUAL = [
    ("3", "4"),
    ("-2", "2"),
    (r"\frac{1}{2}", r"\frac{1}{3}"),
    ("0.5001", r"\frac{1}{2}"),
    (r"(-\infty, 2]", r"(-\infty, 2)"),
    (r"\text{(B)}", r"\text{(A)}"),
    (r"\text{Bob}", r"\text{Evelyn}"),
    (r"2\sqrt{3}", r"3\sqrt{2}"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\3\end{pmatrix}"),
    (r"\frac{1}{0}", "1"),
    ("", "1"),
    ("1", ""),
]


@pytest.mark.parametrize("predicted, reference", EQUAL)
def test_grade_equal(predicted, reference):
    assert grade(predicted, reference) is True


@pytest.mark.parametrize("predicted, reference", NOT_EQUAL)
def test_grade_not_equal(predicted, reference):
    assert grade(predicted, reference) is False


def test_grade_none_prediction():
    assert grade(None, "1") is False


@pytest.mark.parametrize("predicted", [r"\frac{", "}{", r"\sqrt", "\\", "$$", "x===", "((((", "\x00"])
def test_grade_never_raises(predicted):
    assert grade(predicted, r"\frac{1}{2}") is False


def test_grade_off_main_thread():
    results = []
    worker = threading.Thread(
        target=lambda: results.extend(
            [grade(r"2\sqrt{3}", r"\sqrt{12}"), grade(r"x^2-1", r"(x-1)(x+1)"), grade("3", "4")]
        )
    )
    worker.start()
    worker.join(timeout=60)
    assert results == [True, True, False]


def test_grade_hang_is_cut_off(monkeypatch):
    # Expanding 10^(10^10) holds the GIL inside one C call: only killing the helper process stops it.
    usual_deadline = grading.HARD_DEADLINE_S
    monkeypatch.setattr(grading, "HARD_DEADLINE_S", 2.0)
    start = time.monotonic()
    assert grade(r"10^{10^{10}}", "5") is False
    assert time.monotonic() - start < 10
    # the fresh helper starts cold (imports sympy): the usual deadline, so a busy machine cannot flake it
    monkeypatch.setattr(grading, "HARD_DEADLINE_S", usual_deadline)
    assert grade(r"(x+2)^2", r"x^2+4x+4") is True  # a fresh helper takes over (uncached pair)


def test_canonical_form_groups_presentations():
    assert canonical_form(r"\dfrac12") == canonical_form("0.5") == canonical_form(r"\frac{1}{2}")
    assert canonical_form(r"\left( 1, 2 \right)") == canonical_form("(1,2)")
    assert canonical_form(r"10^\circ") == canonical_form("10")
    assert canonical_form("3") != canonical_form("4")
    assert canonical_form(None) == ""


# --- pass@k ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [(5, 2, 1, 0.4), (5, 0, 1, 0.0), (5, 0, 5, 0.0), (5, 4, 2, 1.0), (5, 5, 1, 1.0), (1, 1, 1, 1.0)],
)
def test_pass_at_k_known_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_binomial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    value = pass_at_k(10_000, 3, 100)
    assert 0.0 < value < 1.0
    assert value == pytest.approx(1 - math.comb(9_997, 100) / math.comb(10_000, 100))


@pytest.mark.parametrize(
    "n, c, k, error",
    [(0, 0, 1, ValueError), (5, 6, 1, ValueError), (5, -1, 1, ValueError), (5, 2, 0, ValueError),
     (5, 2, 6, ValueError), (5.0, 2, 1, TypeError), (5, True, 1, TypeError)],
)
def test_pass_at_k_validation(n, c, k, error):
    with pytest.raises(error):
        pass_at_k(n, c, k)


# --- votes -------------------------------------------------------------------------------------


def test_majority_vote_groups_equal_forms():
    assert majority_vote(["3", r"\frac{1}{2}", "0.5", r"\dfrac12", "3"]) == r"\frac{1}{2}"


def test_majority_vote_tie_goes_to_first_seen():
    assert majority_vote(["7", "4", "4", "7"]) == "7"
    assert majority_vote(["4", "7", "7", "4"]) == "4"


def test_majority_vote_ignores_none():
    assert majority_vote([None, None, "2", None]) == "2"
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_weighted_vote_sums_scores_per_group():
    answers = ["1", "2", "2.0", "1"]
    assert weighted_vote(answers, [0.9, 0.5, 0.6, 0.1]) == "2"  # 1.1 vs 1.0
    assert weighted_vote(answers, [0.9, 0.4, 0.5, 0.1]) == "1"  # 1.0 vs 0.9


def test_weighted_vote_tie_and_none():
    assert weighted_vote(["a", "b"], [0.5, 0.5]) == "a"
    assert weighted_vote([None, "b", "a"], [5.0, 0.5, 0.5]) == "b"
    assert weighted_vote([None], [1.0]) is None


def test_naive_best():
    assert naive_best(["1", "2", "3"], [0.2, 0.9, 0.9]) == "2"
    assert naive_best([None, "2"], [0.99, 0.1]) == "2"
    assert naive_best([None, None], [0.1, 0.2]) is None
    assert naive_best(["1", "2"], [-math.inf, -math.inf]) == "1"


def test_votes_reject_length_mismatch():
    with pytest.raises(ValueError):
        weighted_vote(["1", "2"], [1.0])
    with pytest.raises(ValueError):
        naive_best(["1"], [1.0, 2.0])


# --- MATH-500 self-agreement -----------------------------------------------------------------


def test_math500_reference_solutions_grade_correct():
    if not MATH500.exists():
        pytest.skip(f"{MATH500} not found")
    rows = [json.loads(line) for line in MATH500.read_text().splitlines() if line.strip()]
    agreed = sum(grade(extract_answer(row["solution"]), row["answer"]) for row in rows)
    assert len(rows) == 500
    assert agreed / len(rows) >= 0.99
