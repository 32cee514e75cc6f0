"""`benchmarks/block_alloc.py` on a small pool, so the allocation benchmark cannot rot: it runs, each
timed decode is granted its slots (a refused `allocate_slots` is a different, cheaper path), and
arguments it cannot time are refused up front (this checks the script, not speed)."""
import sys
from pathlib import Path

import pytest

from treeserve.engine.kv_cache_manager import KVCacheManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import block_alloc  # noqa: E402


def test_both_measurements_run_on_a_small_pool(capsys):
    block_alloc.main(["--blocks", "64", "--run", "8", "--requests", "3", "--steps", "20", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "allocate, runs of 8 evicting blocks:" in out and "allocate_slots, a decode (16-token blocks):" in out


@pytest.mark.parametrize("block_size", (4, 8, 16))
def test_every_timed_decode_gets_its_slots(monkeypatch, block_size):
    """Small pages (#59's 4-token ones) need more blocks a request: the pool holds them all."""
    granted = []
    allocate_slots = KVCacheManager.allocate_slots
    monkeypatch.setattr(KVCacheManager, "allocate_slots",
                        lambda self, *a, **k: granted.append(allocate_slots(self, *a, **k)) or granted[-1])
    block_alloc.time_decodes(4, 128, block_size)
    assert len(granted) == 4 + 4 * 128 and all(granted)


@pytest.mark.parametrize("argv", (["--blocks", "64", "--run", "128"], ["--run", "0"], ["--block-size", "0"]))
def test_arguments_it_cannot_time_are_refused(argv):
    with pytest.raises(SystemExit) as exit_:
        block_alloc.main(argv + ["--repeats", "1"])
    assert exit_.value.code == 2
