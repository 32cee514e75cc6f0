"""`benchmarks/host_step.py` on a small batch, so the host-time measurement of #59's decode step
cannot rot: it runs, every timed step is one decode row per request (it raises otherwise), and each
output kind works (this checks the script, not speed)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("outputs,sampling", [("delta", "greedy"), ("cumulative", "seeded")])
def test_host_step_times_decode_steps_of_the_whole_batch(outputs, sampling):
    command = [sys.executable, str(ROOT / "benchmarks" / "host_step.py"), "--batch", "4", "--context", "40",
               "--steps", "6", "--repeats", "2", "--outputs", outputs, "--sampling", sampling]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"host time a decode step, batch 4, context 40, {outputs} outputs, {sampling} sampling:" in run.stdout
    assert run.stdout.count("repeat ") == 2
