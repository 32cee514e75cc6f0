"""Benchmarks and scripts are not imported by the other tests; at least they must compile."""
import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_compiles(path):
    py_compile.compile(str(path), doraise=True)


def test_there_is_something_to_check():
    assert len(FILES) >= 5
