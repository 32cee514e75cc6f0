"""treeserve against vLLM's CPU build along the prompt-length axis, offline, in one run.

One prompt at a time (random token ids, greedy, EOS ignored) of 1k, 4k, 8k, 16k and 32k tokens,
with 1 and 128 output tokens, on a 168M random Llama (16/4 heads of 64, 12 layers; see
`treeserve.bench.offline.LONG_PROMPT_SHAPE`). Each pass runs every engine once in a fresh process
(`benchmarks/peer_worker.py`), the order alternating between passes; the figures are medians over
the passes, and the ratio is the median of the per-pass ratios vLLM time / treeserve time (above 1:
treeserve is the faster). Prints time to first token, total time and treeserve's peak RSS, writes
`summary.json` and `prompt_length.png`. vLLM's virtualenv comes from `benchmarks/peers.py --setup`.

    python benchmarks/prompt_length.py [--lengths 1024,4096,8192,16384,32768] [--outputs 1,128]
        [--passes 3] [--engines treeserve,vllm] [--out bench_out/prompt_length] [--resume] [--warm-up-whole]
    python benchmarks/prompt_length.py --merge RUN1/summary.json RUN2/summary.json --out DIR

The same sweep over HTTP: `treeserve bench sweep benchmarks/sweep_long_prompts.yaml`.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from peers import PEERS, TREESERVE, PeerUnavailable, run_worker

from treeserve.bench.offline import LONG_PROMPT_SHAPE, long_prompt_model_dir
from treeserve.config import EngineConfig

LENGTHS = [1024, 4096, 8192, 16384, 32768]
OUTPUTS = [1, 128]
ENGINES = {"treeserve": TREESERVE, "vllm": PEERS["vllm"]}


def jobs_for(lengths: list[int], outputs: list[int], seed: int, vocab: int, concurrency: int = 1) -> list[dict]:
    """One job per (prompt length, output length): `concurrency` requests all in flight at once
    (one request by default); the prompts differ per request and per job."""
    rng = random.Random(seed)
    return [{"name": f"{concurrency}x{length}x{out}", "concurrency": concurrency, "length": length, "output": out,
             "requests": [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)], "max_tokens": out}
                          for _ in range(concurrency)]}
            for length in lengths for out in outputs]


def worker_options(lengths: list[int], outputs: list[int]) -> list[str]:
    return ["--max-model-len", str(max(lengths) + max(outputs)), "--kv-gib", "4"]


def run_pass(number: int, engines: list[str], pythons: dict[str, str], model: Path, jobs: list[dict], out: Path,
             dtype: str, options: list[str]) -> dict[str, dict]:
    order = engines if number % 2 == 0 else engines[::-1]
    results = {}
    for name in order:
        result = run_worker(ENGINES[name], pythons[name], model, jobs, out, dtype, options=options)
        results[name] = result
        times = ", ".join(f"{job['name']} {job['elapsed_s']:.1f} s (TTFT {job['requests'][0]['ttft_s']:.1f} s)"
                          for job in result["jobs"])
        print(f"pass {number + 1}: {ENGINES[name].label}: {times}", flush=True)
    return results


def run_passes(args, engines: list[str], pythons: dict[str, str], model: Path, jobs: list[dict], dtype: str,
               options: list[str]) -> list[dict[str, dict]]:
    """Every pass, each saved to `passes.json` as it ends; `--resume` starts after the saved ones
    (a run cut short keeps what it measured)."""
    saved = args.out / "passes.json"
    shape = [[job["length"], job["output"]] for job in jobs]
    passes = []
    if args.resume and saved.exists():
        record = json.loads(saved.read_text())
        if record["jobs"] != shape or record["dtype"] != dtype:
            raise SystemExit(f"{saved} holds passes of {record['jobs']} in {record['dtype']}, not {shape} in {dtype}")
        passes = record["passes"]
        print(f"resuming after {len(passes)} saved passes", flush=True)
    for number in range(len(passes), args.passes):
        passes.append(run_pass(number, engines, pythons, model, jobs, args.out, dtype, options))
        saved.write_text(json.dumps({"jobs": shape, "dtype": dtype, "passes": passes}))
    return passes


def summarize(passes: list[dict[str, dict]], jobs: list[dict], engines: list[str]) -> list[dict]:
    rows = []
    for index, job in enumerate(jobs):
        row = {"length": job["length"], "output": job["output"]}
        for name in engines:
            runs = [p[name]["jobs"][index] for p in passes if name in p]
            row[name] = {"ttft_s": statistics.median(r["requests"][0]["ttft_s"] for r in runs),
                         "total_s": statistics.median(r["elapsed_s"] for r in runs),
                         "runs_s": [r["elapsed_s"] for r in runs]}
        both = [p for p in passes if all(name in p for name in ("treeserve", "vllm"))]
        if both:
            row["speed_ratio"] = statistics.median(p["vllm"]["jobs"][index]["elapsed_s"] /
                                                   p["treeserve"]["jobs"][index]["elapsed_s"] for p in both)
            row["ttft_ratio"] = statistics.median(p["vllm"]["jobs"][index]["requests"][0]["ttft_s"] /
                                                  p["treeserve"]["jobs"][index]["requests"][0]["ttft_s"] for p in both)
        rows.append(row)
    return rows


def print_table(rows: list[dict], engines: list[str]) -> None:
    header = f"{'prompt':>7}{'out':>5}" + "".join(f"{ENGINES[n].label + ' TTFT':>18}{'total':>9}" for n in engines)
    print("\n" + header + f"{'vLLM/ts total':>15}{'vLLM/ts TTFT':>14}")
    for row in rows:
        line = f"{row['length']:>7}{row['output']:>5}"
        line += "".join(f"{row[n]['ttft_s']:>17.2f}s{row[n]['total_s']:>8.2f}s" for n in engines)
        if "speed_ratio" in row:
            line += f"{row['speed_ratio']:>15.2f}{row['ttft_ratio']:>14.2f}"
        print(line)


def plot(rows: list[dict], engines: list[str], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outputs = sorted({r["output"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in engines:
        for output in outputs:
            mine = [r for r in rows if r["output"] == output]
            axes[0].plot([r["length"] for r in mine], [r[name]["total_s"] for r in mine], marker="o",
                         label=f"{ENGINES[name].label}, {output} out")
    axes[0].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds (median)",
                title="Time for one request")
    axes[0].legend()
    for output in outputs:
        mine = [r for r in rows if r["output"] == output and "speed_ratio" in r]
        axes[1].plot([r["length"] for r in mine], [r["speed_ratio"] for r in mine], marker="o", label=f"{output} out")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set(xscale="log", xlabel="prompt tokens", ylabel="vLLM time / treeserve time",
                title="treeserve's speed relative to vLLM CPU")
    axes[1].legend()
    fig.tight_layout()
    path = out / "prompt_length.png"
    fig.savefig(path, dpi=110)
    return path


def merge_summaries(paths: list[Path], out: Path) -> int:
    """Rows of several runs (e.g. a 3-pass run to 16k and a 1-pass run at 32k), by prompt length."""
    summaries = [json.loads(path.read_text()) for path in paths]
    rows = sorted((row for summary in summaries for row in summary["rows"]), key=lambda r: (r["length"], r["output"]))
    engines = [name for name in ENGINES if all(name in row for row in rows)]
    print_table(rows, engines)
    (out / "summary.json").write_text(json.dumps(summaries[0] | {"rows": rows, "merged": [str(p) for p in paths]},
                                                 indent=2))
    print(f"wrote {plot(rows, engines, out)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--outputs", default=",".join(map(str, OUTPUTS)))
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1, help="requests of each length at once (e.g. 16 x 2,000)")
    parser.add_argument("--engines", default="treeserve,vllm")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has fast bf16, else float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-up-whole", action="store_true", help="each engine's untimed warm-up request is the "
                        "first job's prompt whole, not 16 tokens of it: the timed runs are steady ones")
    parser.add_argument("--out", type=Path, default=Path("bench_out/prompt_length"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the passes an earlier run of the same sweep saved in OUT/passes.json; run the rest")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="SUMMARY",
                        help="run nothing: one table and plot from earlier runs' summary.json files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge_summaries(args.merge, args.out)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    outputs = [int(x) for x in args.outputs.split(",") if x]
    engines = [e for e in args.engines.split(",") if e]
    if unknown := [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    dtype = str(EngineConfig(model=".", dtype=args.dtype).resolve_dtype(torch.device("cpu"), None))
    dtype = dtype.removeprefix("torch.")
    pythons = {}
    for name in engines:
        try:
            pythons[name] = ENGINES[name].python(setup=False)
        except PeerUnavailable as exc:
            print(f"{ENGINES[name].label}: not run, {exc} (python benchmarks/peers.py --setup --peers {name})")
    engines = [e for e in engines if e in pythons]
    model = long_prompt_model_dir()
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in Path("/proc/cpuinfo").read_text()]
    print(f"model: {model} ({LONG_PROMPT_SHAPE['num_hidden_layers']} layers, hidden "
          f"{LONG_PROMPT_SHAPE['hidden_size']}), dtype {dtype}, {torch.get_num_threads()} threads, CPU flags: "
          f"{' '.join(flags)}; prompts {lengths} x outputs {outputs}, {args.passes} passes", flush=True)
    jobs = jobs_for(lengths, outputs, args.seed, LONG_PROMPT_SHAPE["vocab_size"], args.concurrency)
    options = worker_options(lengths, outputs) + (["--warm-up-whole"] if args.warm_up_whole else [])
    passes = run_passes(args, engines, pythons, model, jobs, dtype, options)
    rows = summarize(passes, jobs, engines)
    print_table(rows, engines)
    rss = [p["treeserve"]["peak_rss_bytes"] for p in passes if "treeserve" in p]
    if rss:
        print(f"treeserve's peak RSS over a pass (its longest prompt included): {max(rss) / 2**30:.2f} GiB")
    summary = {"dtype": dtype, "cpu_flags": flags, "threads": torch.get_num_threads(), "rows": rows,
               "versions": {n: passes[0][n]["version"] for n in engines}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {plot(rows, engines, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
