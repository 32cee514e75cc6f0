"""`benchmarks/memory_split.py` on tiny counts, both workloads, so the everyday shared-arena check
cannot rot (this checks the script and its bookkeeping, not speed)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("pair, options", [("random", ["--problems", "4", "--rounds", "2"]),
                                           ("bundled", ["--problems", "4", "--kv-mib", "8"])])
def test_memory_split_runs_a_split_and_the_shared_arena(tmp_path, pair, options):
    command = [sys.executable, str(ROOT / "benchmarks" / "memory_split.py"), "--pair", pair, *options,
               "--repeats", "1", "--splits", "0.5", "--no-bound", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "identical search results in every run: yes" in run.stdout
    assert "shared: thrash by the evicting model" in run.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    shared, static = summary["shared"], summary["static"][0]
    assert shared["tokens_computed_by_model"]["gen"] > 0 and shared["tokens_computed_by_model"]["prm"] > 0
    assert set(shared["thrash_by_evictor"]) == {"gen", "prm"}
    if pair == "bundled":  # the search's own accuracy, the same in either mode (a seeded search)
        assert shared["accuracy"] == static["accuracy"] and 0 <= shared["accuracy"] <= 1


def test_memory_split_runs_the_generator_alone_in_the_whole_budget(tmp_path):
    """The reference beside the splits: the generator gets every page of the budget (twice what the
    0.5 split gives it), the verifier a pool of its own many times larger."""
    command = [sys.executable, str(ROOT / "benchmarks" / "memory_split.py"), "--problems", "4", "--rounds", "2",
               "--repeats", "1", "--splits", "0.5", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "generator alone in the budget" in run.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    alone, half = summary["generator_alone"], summary["static"][0]
    assert abs(alone["kv_blocks"]["gen"] - 2 * half["kv_blocks"]["gen"]) <= 1
    assert alone["kv_blocks"]["prm"] >= 16 * half["kv_blocks"]["prm"]
    assert alone["chosen"] == summary["shared"]["chosen"]
