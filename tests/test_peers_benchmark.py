"""benchmarks/peers.py's summary plot (the peers themselves run only in the benchmark)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("matplotlib")
import peers  # noqa: E402


def _summary(sweep: dict) -> dict:
    row = {"output_tok_s": 800.0, "bins": [30.0, None, 12.5], "mfu": 0.5, "sweep": sweep}
    return {"engines": {"treeserve": row, "vllm": dict(row, output_tok_s=650.0)},
            "bins": [peers.bin_label(lo, hi) for lo, hi in peers.BINS]}


@pytest.mark.parametrize("sweep", [{}, {1: 90.0, 4: 300.0}], ids=["mixed-only", "with-sweep"])
def test_the_plot_draws_without_warnings_with_or_without_a_concurrency_sweep(tmp_path, sweep):
    """`--concurrency ""` runs no sweep: the plot said so with matplotlib's "No artists with labels"
    warning on an empty legend; it now says "no concurrency sweep run" on that panel."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = peers.plot(_summary(sweep), tmp_path)
    assert path.exists() and path.stat().st_size > 0
