"""Test-time compute search: strategies, grading, evaluation."""
from treeserve.search.config import SearchConfig  # noqa: F401
from treeserve.search.grading import extract_answer, grade  # noqa: F401
from treeserve.search.runner import SearchRunner  # noqa: F401
from treeserve.search.tree import SearchResult  # noqa: F401
