"""Grader self-agreement on MATH-500: grade(extract_answer(solution), answer) for every row.

Prints the agreement rate and every disagreement as (unique_id, extracted, answer). The reference
solutions' boxed answers match the answer field almost verbatim, so this mostly exercises extraction
and the string check; --symbolic also sends every answer through math-verify alone (against itself)
and grades each answer against the next row's (false positives).

    python benchmarks/grader_agreement.py [--data data/math500.jsonl] [--symbolic]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from treeserve.search.grading import _symbolic_equal, extract_answer, grade

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data" / "math500.jsonl"


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def disagreements(rows: list[dict]) -> list[tuple[str, str | None, str]]:
    """(unique_id, extracted, answer) for every row whose own solution does not grade as correct."""
    misses = []
    for row in rows:
        extracted = extract_answer(row["solution"])
        if not grade(extracted, row["answer"]):
            misses.append((row["unique_id"], extracted, row["answer"]))
    return misses


def symbolic_report(rows: list[dict]) -> None:
    """math-verify alone on answer-vs-itself, and grade() on answer-vs-next-row's-answer."""
    answers = [row["answer"] for row in rows]
    start = time.perf_counter()
    unparsed = [a for a in answers if not _symbolic_equal(a, a)]
    print(f"math-verify self-equal: {len(answers) - len(unparsed)}/{len(answers)}"
          f" ({time.perf_counter() - start:.1f} s)")
    for answer in unparsed:
        print(f"  not self-equal: {answer!r}")
    start = time.perf_counter()
    pairs = [(a, b) for a, b in zip(answers, answers[1:] + answers[:1]) if a != b and grade(a, b)]
    print(f"cross-row matches between different answers: {len(pairs)} ({time.perf_counter() - start:.1f} s)")
    for a, b in pairs:
        print(f"  {a!r} == {b!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--symbolic", action="store_true", help="also run the math-verify-only checks")
    args = parser.parse_args()

    rows = load_rows(args.data)
    start = time.perf_counter()
    misses = disagreements(rows)
    elapsed = time.perf_counter() - start

    agreed = len(rows) - len(misses)
    print(f"agreement: {agreed}/{len(rows)} = {agreed / len(rows):.2%} ({elapsed:.1f} s)")
    for unique_id, extracted, answer in misses:
        print(f"  {unique_id}\textracted={extracted!r}\tanswer={answer!r}")
    if args.symbolic:
        symbolic_report(rows)


if __name__ == "__main__":
    main()
