"""`benchmarks/gpu.py --smoke --device cpu`: every section but the CUDA tests on tiny shapes, so the
device call cannot rot between the sessions that are lent a GPU (this checks the script, the HF
peers' API and the founding study's bookkeeping, not speed)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_founding  # noqa: E402
import gpu_models as gm  # noqa: E402

from treeserve.engine.kv_arena import fitted_page_bytes  # noqa: E402
SECTIONS = "decode,decode_sync,decode_rotary_apart,offline,bundled_search,founding_search,spec_search"


def test_gpu_benchmark_smoke_runs_every_section(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu",
               "--sections", SECTIONS, "--founding-profile", "--out", str(tmp_path)]
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
        for model, by in row["thrash_by_evictor"].items():  # this run's evictions, each by a model of the run
            assert all(count >= 0 for count in by.values()) and sum(by.values()) <= row["thrash"][model]
            assert set(by) <= ({model} if label.startswith("static") else {"gen", "prm"})
    ceiling, shared = founding["runs"]["unconstrained"][0], founding["runs"]["shared"][0]
    assert ceiling["block_size"] == founding["runs"]["static gen=0.5"][0]["block_size"]  # the splits' pages
    for model, fraction in gpu_founding.CEILING_FRACTIONS.items():  # in 3x the budget (both tiny models alike)
        assert abs(ceiling["kv_blocks"][model] - 3 * fraction * shared["kv_blocks"][model]) <= 1
    assert founding["runs"]["shared, 32-token pages"][0]["block_size"]["gen"] == 32
    summary = founding["summary"]
    assert summary["best_static"] in ("static gen=0.4", "static gen=0.5")
    assert "shared / best static" in summary and "unconstrained / best static" in summary
    assert any(row[0].startswith("1B+8B beam N=16 (shared)") for row in results["table"])
    profiles = founding["profiles"]  # one more run of each, per-model step ranges in the profiler
    assert set(profiles) == {"shared", summary["best_static"]}
    for label, profiled in profiles.items():
        per_model = profiled["profile"]["per_model"]
        steps = {model: founding["runs"][label][0]["steps"][model]["steps"] for model in ("gen", "prm")}
        assert {model: row["steps"] for model, row in per_model.items()} == steps  # the same search, every step
        assert all(row["host_s"] > 0 for row in per_model.values())
    spec = results["spec_search"]
    assert len(spec["problems_s"]["none"]) == len(spec["problems_s"]["suffix"]) == 1
    assert spec["accuracy"]["none"] == spec["accuracy"]["suffix"]  # seeded: the same search either way
    assert any(row[0].startswith("bundled beam N=16, sibling suffix") for row in results["table"])


def test_the_founding_replica_holds_the_device_runs_pages(tmp_path):
    """`--founding-replica`: its tiny models in its scaled budget get as many pages from a Runtime as
    the page arithmetic gives the 1B and 8B shapes in bfloat16 in the device's budget, in the shared
    arena and in a static split."""
    from treeserve import Runtime
    from treeserve.engine.kv_arena import aligned

    device = [gpu_founding.kv_bytes_per_token(s, torch.bfloat16) for s in (gm.LLAMA_3_2_1B, gm.LLAMA_3_1_8B)]
    assert device == [32 << 10, 128 << 10]
    budget = 4 << 30
    paths = {name: str(gm.model_dir(tmp_path, name, shape, 512))
             for name, shape in zip(("gen", "prm"), gpu_founding.REPLICA_SHAPES)}
    options = dict(dtype=gpu_founding.REPLICA_DTYPE, device="cpu", load_format="dummy", max_model_len=256,
                   max_num_batched_tokens=256, kv_cache_memory_bytes=int(budget * gpu_founding.replica_kv_scale()))
    shared = Runtime(paths, kv_mode="shared", **options)
    try:
        pages = budget // aligned(fitted_page_bytes(device, 16))
        assert {n: e.stats().kv_blocks_total for n, e in shared.engines.items()} == {"gen": pages, "prm": pages}
        assert pages == 8192
    finally:
        shared.close()
    fractions = {"gen": 0.3, "prm": 0.7}
    split = Runtime(paths, kv_mode="static", kv_fractions=fractions, **options)
    try:
        expected = {n: int(budget * fractions[n]) // aligned(16 * d) for n, d in zip(("gen", "prm"), device)}
        assert {n: e.stats().kv_blocks_total for n, e in split.engines.items()} == expected == {"gen": 2457, "prm": 1433}
    finally:
        split.close()


def test_the_founding_runtimes_over_the_loaded_models_have_the_options_they_claim(tmp_path):
    """Each configuration's Runtime is built over models loaded once: the engines have the load's
    scheduler options (16 problems' candidates, 8,192-token steps), the configuration's page size and
    its split, as the study says."""
    from types import SimpleNamespace

    paths = {name: gm.model_dir(tmp_path, name, shape, 512) for name, shape in zip(("gen", "prm"), gpu_founding.REPLICA_SHAPES)}
    args = SimpleNamespace(dtype=gpu_founding.REPLICA_DTYPE, device="cpu", founding_max_len=256, founding_kv_gib=1 / 64)
    loaded = gpu_founding.load_models(args, paths)
    configs = dict(gpu_founding.configurations([0.3], 32))
    for label, block_size in (("shared, 32-token pages", 32), ("static gen=0.3", 16)):
        rt = gpu_founding.build_runtime(args, loaded, configs[label])
        try:
            assert rt.engines["gen"].stats().block_size == block_size, label
            for engine in rt.engines.values():
                assert engine.scheduler.max_num_seqs == 16 * gpu_founding.MAX_IN_FLIGHT
                assert engine.scheduler.max_num_batched_tokens == 8192 and engine.max_model_len == 256
        finally:
            rt.close()
    assert all(m.config.block_size == 16 for m in loaded.values())  # the loaded models keep their own


def test_the_founding_summary_takes_the_middle_of_an_even_count_of_rounds():
    """A round cut by the time limit leaves two runs a configuration: their median is their mean
    (the upper one of two overstated shared / best static as 1.10x for rounds of 0.98x and 1.10x)."""
    runs = {"static gen=0.3": [{"problems_s": 1.70}, {"problems_s": 1.66}],
            "shared": [{"problems_s": 1.67}, {"problems_s": 1.83}]}
    summary = gpu_founding.summarize(runs)
    assert summary["median_problems_s"] == {"static gen=0.3": pytest.approx(1.68), "shared": pytest.approx(1.75)}
    assert summary["shared / best static"] == pytest.approx(1.75 / 1.68)
    assert summary["shared / best static, median of rounds"] == pytest.approx((1.67 / 1.70 + 1.83 / 1.66) / 2)
