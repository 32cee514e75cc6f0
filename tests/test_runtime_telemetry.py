"""Runtime(..., trace_path=...): docs/METRICS.md's per-step JSONL telemetry."""
from __future__ import annotations

import json

from treeserve import Runtime, SamplingParams

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
DOCUMENTED = {"model", "blocks_in_use", "blocks_cached", "blocks_free", "blocks_total", "blocks_wanted",
              "prefix_queries", "prefix_hits", "evictions", "thrash", "preemptions"}


def test_trace_lines_are_readable_while_the_runtime_runs(tiny_model_dirs, tmp_path):
    """Each step's line is in the file as soon as the step is done (a plotting script or `tail -f`
    reads it while the runtime lives), not held in a write buffer until `close`."""
    trace = tmp_path / "trace.jsonl"
    rt = Runtime({"gen": tiny_model_dirs["llama"], "prm": tiny_model_dirs["qwen2"]}, recipes={"prm": "rlhflow"},
                 trace_path=trace, **OPTIONS)
    try:
        rt.generate("gen", [{"prompt_token_ids": list(range(3, 23))}], SamplingParams(max_tokens=4, ignore_eos=True))
        lines = trace.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines]
        steps = rt.engine("gen").num_steps
        assert steps > 0 and len([r for r in records if r["model"] == "gen"]) == steps
        assert all(DOCUMENTED <= set(r) for r in records)
    finally:
        rt.close()
