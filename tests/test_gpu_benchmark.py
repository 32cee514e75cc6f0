"""`benchmarks/gpu.py --smoke --device cpu`: every section but the CUDA tests on tiny shapes, so the
device call cannot rot between the sessions that are lent a GPU (this checks the script, the HF
peers' API and the founding study's bookkeeping, not speed)."""
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_founding  # noqa: E402
import gpu_models as gm  # noqa: E402

from treeserve.engine.kv_arena import fitted_page_bytes  # noqa: E402
SECTIONS = "decode,decode_sync,offline,bundled_search,founding_search,spec_search"


def test_gpu_benchmark_smoke_runs_every_section(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu",
               "--sections", SECTIONS, "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    failed = {name: results[name]["error"] for name in SECTIONS.split(",") if "error" in results[name]}
    assert not failed, failed
    founding = results["founding_search"]
    assert set(founding["build_seconds"]) == set(founding["runs"])  # every configuration built (once)
    assert set(founding["runs"]) == {"static gen=0.4", "static gen=0.5", "shared", "shared, 32-token pages",
                                     "unconstrained"}
    for label, rows in founding["runs"].items():
        assert len(rows) == 1 and "error" not in rows[0], (label, rows)
        row = rows[0]
        assert row["tokens_computed"]["gen"] > 0 and row["tokens_computed"]["prm"] > 0
        assert set(row["blocks_in_use"]) == {"gen", "prm"}
        assert set(row["thrash_by_evictor"]) == {"gen", "prm"}
    ceiling = founding["runs"]["unconstrained"][0]
    assert ceiling["kv_blocks"]["gen"] == 3 * founding["runs"]["shared"][0]["kv_blocks"]["gen"]  # 3x the budget
    assert founding["runs"]["shared, 32-token pages"][0]["block_size"]["gen"] == 32
    summary = founding["summary"]
    assert summary["best_static"] in ("static gen=0.4", "static gen=0.5")
    assert "shared / best static" in summary and "unconstrained / best static" in summary
    assert any(row[0].startswith("1B+8B beam N=16 (shared)") for row in results["table"])
    spec = results["spec_search"]
    assert len(spec["problems_s"]["none"]) == len(spec["problems_s"]["suffix"]) == 1
    assert spec["accuracy"]["none"] == spec["accuracy"]["suffix"]  # seeded: the same search either way
    assert any(row[0].startswith("bundled beam N=16, sibling suffix") for row in results["table"])


def test_the_founding_replica_holds_the_device_runs_pages():
    """`--founding-replica`: its tiny models in its scaled budget hold as many pages as the 1B and 8B
    shapes in bfloat16 in the device's budget, in the shared arena and in every static split."""
    device = [gpu_founding.kv_bytes_per_token(s, torch.bfloat16) for s in (gm.LLAMA_3_2_1B, gm.LLAMA_3_1_8B)]
    replica = [gpu_founding.kv_bytes_per_token(s, torch.float32) for s in gpu_founding.REPLICA_SHAPES]
    assert device == [32 << 10, 128 << 10]
    budget = 4 << 30
    scaled = budget * gpu_founding.replica_kv_scale()
    assert budget // fitted_page_bytes(device, 16) == scaled // fitted_page_bytes(replica, 16) == 8192
    for split in gpu_founding.SPLITS:
        for share, d, r in zip((split, 1 - split), device, replica):
            assert int(share * budget) // (16 * d) == int(share * scaled) // (16 * r)
