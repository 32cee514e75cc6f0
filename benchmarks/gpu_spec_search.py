"""gpu.py's `spec_search` section: issue #57's search target where a decode step is the weights'
bytes, not the CPU's arithmetic. The bundled pair's beam search (N=16, width 4, 8 iterations) with
and without sibling suffix speculation (drafts from each problem's other candidates and earlier
outputs), the two alternating, `--spec-repeats` rounds, medians of the per-round ratios; the
accuracy of each (a seeded search returns the same results with or without drafts).

On this project's 2-core CPUs the same comparison measured 0.91-1.05x (benchmarks/spec_decode.py
--sections search): a generator step there is per-token arithmetic, so a kept draft token costs
what a decoded one does. On a GPU a step of the tiny generator is launch and weight-read time, the
case speculation is for.
"""
from __future__ import annotations

import statistics
import time

from treeserve import Runtime
from treeserve.search.config import SearchConfig, declared_aggregation
from treeserve.search.grading import grade
from treeserve.search.runner import SearchRunner

SUFFIX = {"method": "suffix", "num_speculative_tokens": 16, "prompt_lookup_max": 8, "prompt_lookup_min": 1}
ARMS = {"none": None, "suffix": SUFFIX}
TARGET = ">= 1.4x (#57)"


def run(args, problems: int, repeats: int) -> dict:
    """Both arms on `args.device`, each with its own Runtime built once and warmed up on 2 problems."""
    from treeserve.model.registry import DEFAULT_GENERATOR, DEFAULT_VERIFIER
    from treeserve.tasks.arithmetic import generate

    rows = [p.row() for p in generate("test", problems + 2, seed=0)]
    warm, rows = rows[:2], rows[2:]
    runtimes = {name: Runtime({"gen": DEFAULT_GENERATOR, "prm": DEFAULT_VERIFIER}, device=args.device,
                              kv_cache_memory_bytes=256 << 20) for name in ARMS}
    try:
        agg = declared_aggregation(runtimes["none"].engine("prm").model_dir)
        configs = {name: SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=8, max_tokens=256, seed=0,
                                      agg_strategy=agg, speculative_config=spec) for name, spec in ARMS.items()}
        for name, rt in runtimes.items():
            SearchRunner(rt.engine("gen"), rt.scorer("prm")).run([r["problem"] for r in warm], configs[name])
        rates: dict[str, list[float]] = {name: [] for name in ARMS}
        accuracy: dict[str, float] = {}
        for _ in range(repeats):
            for name, rt in runtimes.items():
                rates[name].append(_timed(rt, rows, configs[name], accuracy, name))
        accepted, drafted = _draft_counts(runtimes["suffix"])
    finally:
        for rt in runtimes.values():
            rt.close()
    ratios = [s / n for s, n in zip(rates["suffix"], rates["none"])]
    result = {"problems": len(rows), "problems_s": rates, "accuracy": accuracy, "ratio": statistics.median(ratios),
              "ratios": ratios, "accepted_draft_tokens": accepted, "draft_tokens": drafted}
    print(f"spec search: suffix / none {result['ratio']:.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}), "
          f"accuracy {accuracy}, {accepted}/{drafted} draft tokens kept")
    return result


def _timed(rt: Runtime, rows: list[dict], config: SearchConfig, accuracy: dict, name: str) -> float:
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"))
    start = time.perf_counter()
    results = runner.run([r["problem"] for r in rows], config)
    seconds = time.perf_counter() - start
    accuracy[name] = sum(grade(r.pred, row["answer"]) for r, row in zip(results, rows)) / len(rows)
    print(f"spec search {name:6s} {len(rows) / seconds:7.2f} problems/s, accuracy {accuracy[name]:.1%}", flush=True)
    return len(rows) / seconds


def _draft_counts(rt: Runtime) -> tuple[int, int]:
    stats = rt.engine("gen").stats()
    return stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens


def table_rows(result: dict) -> list[list[str]]:
    if "ratio" not in result:
        return []
    rates = result["problems_s"]
    return [["bundled beam N=16, sibling suffix speculation", f"{statistics.median(rates['suffix']):.2f} problems/s",
             f"{statistics.median(rates['none']):.2f} (none)", f"{result['ratio']:.2f}x", TARGET]]
