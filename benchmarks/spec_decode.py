"""Speculative decoding against decoding without it, and against vLLM CPU's n-gram speculation, in one run.

Sections (`--sections`, default all):
- `bundled`: the bundled generator (builtin:arith-gen, dtype auto), greedy chat answers to the
  arithmetic task's test questions, one at a time (batch 1) and 16 at once; no speculation, `ngram`,
  `suffix`, `draft_model` (the generator's own first layer as the draft: a smaller model with its
  tokenizer, untrained as a draft) and `eagle3` with a random head (no trained head exists for it:
  what capturing the features and pricing the passes cost when the drafts are never kept). The configurations alternate, `--repeats` times after a warm-up of 8 questions (a
  `suffix` engine has then seen earlier answers, as a serving engine has); every configuration's
  tokens are checked equal to those without speculation.
- `search`: beam search N=16 (width 4, 8 iterations) with the bundled pair on `--problems` test
  questions, `--problems-in-flight` at once (32, the runner's default; 1: one question at a time),
  with and without `suffix` speculation (the problem's sibling sequences and earlier outputs):
  problems/s and accuracy.
- `copy`: a random 168M Llama (`treeserve.bench.offline.LONG_PROMPT_SHAPE`) on copy-heavy prompts (a
  random document, then its first half again, as a quote to continue), greedy, at 1, 8 and 64
  requests in flight; treeserve and vLLM CPU (`--peers vllm`, its virtualenv from
  `benchmarks/peers.py --setup`), each without and with `ngram` speculation, every engine in a fresh
  process (`benchmarks/peer_worker.py`), passes alternating. A random model does not continue the
  quote: its greedy text falls into cycles, which is what prompt lookup drafts from here. Also
  treeserve with `draft_model` (the random model's first layer as the draft).

Prints tokens/s (or problems/s), acceptance (accepted / draft tokens) and each configuration's
ratio to no speculation (median of the back-to-back pairs' ratios).

    python benchmarks/spec_decode.py [--sections bundled,search,copy] [--repeats 3] [--problems 100]
        [--peers vllm] [--passes 2] [--out bench_out/spec_decode]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from peers import PEERS, TREESERVE, PeerUnavailable, run_worker

from treeserve import LLM, Runtime, SamplingParams
from treeserve.bench.offline import LONG_PROMPT_SHAPE, long_prompt_model_dir
from treeserve.model.random_models import make_tiny_eagle_head
from treeserve.model.registry import resolve_model_path
from treeserve.search.config import SearchConfig
from treeserve.search.grading import grade
from treeserve.search.runner import SearchRunner
from treeserve.tasks.arithmetic import generate

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 16, "prompt_lookup_max": 8, "prompt_lookup_min": 1}
WARM_QUESTIONS = 8
DRAFT_LAYERS = 1  # `draft_model`: the target's first layers, its embeddings, norm and head


def first_layers(source: Path, dest: Path, layers: int = DRAFT_LAYERS) -> Path:
    """A copy of a single-file Llama checkpoint keeping only its first `layers` decoder layers: a
    smaller model with the target's tokenizer (a self-speculative draft without training)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(config))
    weights = load_file(dest / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def draft_config(source: Path, out: Path) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": 4,
            "model": str(first_layers(source, out / f"{source.name}-draft"))}


def median_ratios(runs: dict[str, list[float]], base: str = "none") -> dict[str, float]:
    return {name: statistics.median(a / b for a, b in zip(values, runs[base])) for name, values in runs.items()}


def spec_counts(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens


# ---- bundled generator, greedy ------------------------------------------------------------------
def bundled(args) -> None:
    rows = [p.row() for p in generate("test", WARM_QUESTIONS + args.questions, seed=0)]
    chats = [[{"role": "user", "content": r["problem"]}] for r in rows]
    params = SamplingParams(temperature=0, max_tokens=256)
    generator = resolve_model_path("builtin:arith-gen")
    head = make_tiny_eagle_head("eagle3", generator, args.out / "arith-gen-eagle3-random")
    configs = {"none": None, "ngram": NGRAM, "suffix": SUFFIX, "draft": draft_config(generator, args.out),
               "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}}
    engines = {name: LLM("builtin:arith-gen", speculative_config=spec) for name, spec in configs.items()}
    for llm in engines.values():
        for chat in chats[:WARM_QUESTIONS]:
            llm.chat([chat], params, use_tqdm=False)
    for batch in (1, 16):
        runs = {name: [] for name in engines}
        tokens = {}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                before = spec_counts(llm.engine)
                start = time.perf_counter()
                outputs = []
                for first in range(WARM_QUESTIONS, len(chats), batch):
                    outputs += llm.chat(chats[first:first + batch], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                ids = [o.outputs[0].token_ids for o in outputs]
                tokens.setdefault(name, ids)
                accepted, drafted = (a - b for a, b in zip(spec_counts(llm.engine), before))
                runs[name].append(sum(map(len, ids)) / seconds)
                print(f"bundled batch {batch:2d} {name:6s} {runs[name][-1]:8.1f} tok/s"
                      + (f"  accepted {accepted}/{drafted} draft tokens" if drafted else ""), flush=True)
        same = {name: ids == tokens["none"] for name, ids in tokens.items()}
        for name, ratio in median_ratios(runs).items():
            print(f"bundled batch {batch:2d} {name:6s} median {statistics.median(runs[name]):8.1f} tok/s, "
                  f"{ratio:.2f}x no speculation, tokens identical: {same[name]}")


# ---- beam search --------------------------------------------------------------------------------
def search(args) -> None:
    rows = [p.row() for p in generate("test", args.problems, seed=0)]
    questions = [r["problem"] for r in rows]
    runs: dict[str, list[float]] = {"none": [], "suffix": []}
    for _ in range(args.repeats):
        for name, spec in (("none", None), ("suffix", SUFFIX)):
            config = SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=8, max_tokens=256, seed=0,
                                  speculative_config=spec)
            rt = Runtime({"gen": "builtin:arith-gen", "prm": "builtin:arith-prm"}, device="cpu",
                         kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=4096)
            runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"), max_problems_in_flight=args.problems_in_flight)
            start = time.perf_counter()
            results = runner.run(questions, config)
            seconds = time.perf_counter() - start
            accuracy = sum(grade(r.pred, row["answer"]) for r, row in zip(results, rows)) / len(rows)
            accepted, drafted = spec_counts(rt.engine("gen"))
            runs[name].append(len(rows) / seconds)
            print(f"search {name:6s} {runs[name][-1]:6.2f} problems/s, accuracy {accuracy:.1%}"
                  + (f", accepted {accepted}/{drafted} draft tokens" if drafted else ""), flush=True)
            rt.close()
    for name, ratio in median_ratios(runs).items():
        print(f"search {name:6s} median {statistics.median(runs[name]):6.2f} problems/s, {ratio:.2f}x no speculation")


# ---- copy-heavy prompts on a random 168M Llama ---------------------------------------------------
def copy_jobs(concurrencies: list[int], seed: int, vocab: int) -> list[dict]:
    rng = random.Random(seed)

    def request() -> dict:
        document = [rng.randrange(10, vocab) for _ in range(192)]
        return {"prompt_token_ids": document + document[:96], "max_tokens": 128}
    return [{"name": f"copy x{c}", "concurrency": c, "requests": [request() for _ in range(max(c, 4))]}
            for c in concurrencies]


def decode_tok_s(job: dict) -> float:
    """Output tokens after the first over the time from the first token to the last, per request,
    summed over the requests in flight (median request rate x concurrency)."""
    rates = [(r["output_tokens"] - 1) / (r["latency_s"] - r["ttft_s"]) for r in job["requests"]
             if r["latency_s"] > r["ttft_s"]]
    return statistics.median(rates) * min(job["concurrency"], len(job["requests"]))


def copy(args) -> None:
    model = long_prompt_model_dir()
    jobs = copy_jobs(args.concurrency, 0, LONG_PROMPT_SHAPE["vocab_size"])
    arms = [(TREESERVE, "none", None), (TREESERVE, "ngram", NGRAM), (TREESERVE, "draft", draft_config(model, args.out))]
    pythons = {"treeserve": sys.executable}
    for name in args.peers:
        try:
            pythons[name] = PEERS[name].python(setup=False)
            arms += [(PEERS[name], "none", None), (PEERS[name], "ngram", NGRAM)]
        except PeerUnavailable as exc:
            print(f"copy: {name} skipped: {exc}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for number in range(args.passes):
        order = arms if number % 2 == 0 else arms[::-1]
        for peer, method, spec in order:
            label = f"{peer.name} {method}"
            options = ["--max-model-len", "1024", "--kv-gib", "2"]
            if spec:
                options += ["--speculative-config", json.dumps(spec)]
            try:
                result = run_worker(peer, pythons[peer.name], model, jobs, args.out, "bfloat16", options=options)
            except RuntimeError as exc:
                print(f"copy: {label} failed: {exc}")
                continue
            results.setdefault(label, []).append(result)
            figures = ", ".join(f"x{j['concurrency']} {decode_tok_s(j):7.1f}" for j in result["jobs"])
            last = result["jobs"][-1]
            accepted = (f"  accepted {last['spec_accepted_tokens']}/{last['spec_draft_tokens']} draft tokens"
                        if last.get("spec_draft_tokens") else "")
            print(f"copy pass {number + 1} {label:16s} decode tok/s: {figures}{accepted}", flush=True)
    (args.out / "copy.json").write_text(json.dumps(results))
    for peer, method, _ in arms:
        base, spec = results.get(f"{peer.name} none", []), results.get(f"{peer.name} {method}", [])
        for i, concurrency in enumerate(args.concurrency if method != "none" else ()):
            ratios = [decode_tok_s(s["jobs"][i]) / decode_tok_s(b["jobs"][i]) for b, s in zip(base, spec)]
            if ratios:
                print(f"copy {peer.name:9s} x{concurrency:<3d} {method} / none: {statistics.median(ratios):.2f}x "
                      f"(median of {len(ratios)} pass(es))")
    if "vllm ngram" in results and "treeserve ngram" in results:
        for i, concurrency in enumerate(args.concurrency):
            ratios = [decode_tok_s(t["jobs"][i]) / decode_tok_s(v["jobs"][i])
                      for t, v in zip(results["treeserve ngram"], results["vllm ngram"])]
            print(f"copy x{concurrency:<3d} treeserve ngram / vLLM ngram: {statistics.median(ratios):.2f}x")


SECTIONS = {"bundled": bundled, "search": search, "copy": copy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="bundled,search,copy")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=int, default=32, help="bundled: questions after the warm-up")
    parser.add_argument("--problems", type=int, default=100, help="search: test problems")
    parser.add_argument("--problems-in-flight", type=int, default=32,
                        help="search: problems searched at once (1: one question at a time, as an interactive user)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="copy: requests in flight")
    parser.add_argument("--peers", nargs="*", default=["vllm"], help="copy: peers to run beside treeserve")
    parser.add_argument("--passes", type=int, default=2, help="copy: passes (engines alternate between passes)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/spec_decode"))
    args = parser.parse_args()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    print(f"{torch.get_num_threads()} threads; avx512_bf16: {'avx512_bf16' in flags}, amx: {'amx_bf16' in flags}")
    for name in args.sections.split(","):
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
