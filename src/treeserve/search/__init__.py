"""Test-time compute search: strategies, grading, evaluation."""
from treeserve.search.grading import extract_answer, grade  # noqa: F401
