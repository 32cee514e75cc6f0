"""Test-time compute search: strategies, grading, evaluation."""
import importlib

from treeserve.search.grading import extract_answer, grade  # noqa: F401

# Loaded when first asked for (`from treeserve.search import SearchRunner`): the runner brings the
# engine and PyTorch, which grading and the other light modules of this package do without.
_LAZY = {"SearchConfig": "treeserve.search.config", "SearchRunner": "treeserve.search.runner",
         "SearchResult": "treeserve.search.tree"}
__all__ = ["extract_answer", "grade", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
