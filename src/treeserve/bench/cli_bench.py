"""`treeserve bench serve|report|sweep|calibrate|throughput`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from treeserve.arg_types import given, port, with_scheme, without_password

SERVE_OPTIONS = ("base_url", "model", "api_key", "out", "endpoint", "stream", "dataset", "dataset_path", "input_len",
                 "output_len", "range_ratio", "shared_prefix_len", "shared_prefix_groups", "vocab_size", "tokenizer",
                 "concurrency", "request_rate", "burstiness", "num_requests", "duration", "warmup", "seed", "goodput",
                 "ignore_eos", "temperature", "telemetry_interval", "plots", "ready_check_timeout_sec")


def add_bench_parsers(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: load against a server, reports, sweeps, offline throughput")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve_parser(kinds)
    report = kinds.add_parser("report", help="redraw a run's report, or compare several runs side by side")
    report.add_argument("runs", nargs="+", type=Path, help="run directories (each with summary.json)")
    report.add_argument("--out", type=Path, default=Path("bench-compare"), help="where a comparison is written")
    report.set_defaults(func=cmd_report)
    sweep = kinds.add_parser("sweep", help="start servers from a YAML file, benchmark each, stop them")
    sweep.add_argument("sweep_file", type=Path)
    sweep.set_defaults(func=cmd_sweep)
    calibrate = kinds.add_parser("calibrate", help="measure the client's overhead against a mock server")
    calibrate.add_argument("--ttft-ms", type=float, default=200.0)
    calibrate.add_argument("--itl-ms", type=float, default=40.0)
    calibrate.add_argument("--concurrency", type=int, default=64)
    calibrate.add_argument("--num-requests", type=int, default=128)
    calibrate.add_argument("--output-len", type=int, default=32)
    calibrate.add_argument("--port", type=_port, default=18099)
    calibrate.add_argument("--out", type=Path, default=Path("bench-calibration"))
    calibrate.set_defaults(func=cmd_calibrate)
    throughput = kinds.add_parser("throughput", help="offline engine throughput against HF transformers, same run")
    add_throughput_arguments(throughput)
    throughput.set_defaults(func=cmd_throughput)


def _add_serve_parser(kinds) -> None:
    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server; write a run directory")
    serve.add_argument("--base-url", required=True, type=_base_url, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", type=_served_model, help="default: the first model of GET /v1/models")
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    serve.add_argument("--out", required=True, help="run directory")
    serve.add_argument("--endpoint", type=endpoint_kind, choices=["completions", "chat"], default="completions",
                       help="completions or chat (vLLM's /v1/completions and /v1/chat/completions too)")
    serve.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    serve.add_argument("--dataset", "--dataset-name", type=lambda name: "jsonl" if name == "custom" else name,
                       choices=["random", "sharegpt", "jsonl", "math500"], default="random",
                       help="vLLM's 'custom' (a JSONL of 'prompt') is jsonl")
    serve.add_argument("--dataset-path", help="file for sharegpt (JSON), jsonl ('prompt' per line), math500")
    serve.add_argument("--input-len", "--random-input-len", default="256",
                       help="prompt tokens (random dataset); comma list sweeps")
    serve.add_argument("--output-len", "--random-output-len", default=None,
                       help="max_tokens, EOS ignored (default 128 random, reference length else); comma list sweeps")
    serve.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                       help="lengths vary by +-this fraction")
    serve.add_argument("--shared-prefix-len", type=int, default=0, help="tokens shared within a prefix bucket")
    serve.add_argument("--shared-prefix-groups", type=int, default=1, help="number of shared-prefix buckets")
    serve.add_argument("--vocab-size", type=int, help="random token ids below this (default 256)")
    serve.add_argument("--tokenizer", type=_tokenizer_dir, help="HF tokenizer directory: vocabulary and prompt lengths")
    serve.add_argument("--concurrency", "--max-concurrency", default=None,
                       help="requests in flight, comma list sweeps: 1,4,16")
    serve.add_argument("--request-rate", default="inf", help="requests/s (Poisson or gamma arrivals), comma list")
    serve.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    serve.add_argument("--num-requests", "--num-prompts", type=int, default=100, help="requests per level")
    serve.add_argument("--duration", type=float, help="stop sending after this many seconds per level")
    serve.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of the figures")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    serve.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--telemetry-interval", type=float, default=0.2, help="seconds between /metrics scrapes")
    serve.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True)
    serve.add_argument("--ready-check-timeout-sec", type=float, default=600,
                       help="wait up to this long for a server still loading (GET /v1/models), as vLLM's; "
                            "0: no waiting")
    for option, answer in VLLM_ONLY_OPTIONS.items():
        serve.add_argument(option, nargs="?", action=_NotHere, help=argparse.SUPPRESS, answer=answer)
    serve.set_defaults(func=cmd_serve)


# --model: a served model's name (an empty one was the flag left out: the first model was benchmarked)
_served_model = given("give a served model's name, or leave the flag out for the first of GET /v1/models")
_tokenizer_dir = given("give an HF tokenizer directory, or leave the flag out")


def _base_url(text: str) -> str:
    """(a URL without its scheme was waited on as a server still loading, for --ready-check-timeout-sec)"""
    url = with_scheme(text, ("http", "https"))
    if url is None:
        raise argparse.ArgumentTypeError(f"expected an http(s):// URL such as http://127.0.0.1:8000, got {without_password(text)!r}")
    return url


def _port(text: str) -> int:
    """(--port 99999 was the mock server's traceback, then wait_healthy's; 0 leaves the port unknown to the client)"""
    return port(text, lowest=1)


def _counts(text: str) -> str:
    """Comma-separated whole numbers >= 1, kept as given (`x` was "invalid literal for int()" after the
    workload was made and, for --tensor-parallel-size, after HF's run)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1 such as 1,2, got {text!r}")
    return text


# `vllm bench serve` options with no counterpart of the same name, and what to use instead
VLLM_ONLY_OPTIONS = {
    "--backend": "it speaks the OpenAI API to any server; --endpoint completions|chat picks the route",
    "--save-result": "it always writes a run directory: --out DIR (summary.json, requests.jsonl, report.md)",
    "--result-dir": "give the run directory as --out DIR",
    "--result-filename": "the figures go to summary.json in the --out directory",
    "--percentile-metrics": "it always reports mean, median, p90 and p99 of TTFT, TPOT, ITL and E2EL",
    "--metric-percentiles": "it always reports mean, median, p90 and p99 of TTFT, TPOT, ITL and E2EL",
}


class _NotHere(argparse.Action):
    """A vLLM option treeserve lacks: an error that says what to use instead."""

    def __init__(self, *args, answer: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.answer = answer

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a `vllm bench serve` option; treeserve bench serve has none: {self.answer}")


def endpoint_kind(value: str) -> str:
    """'completions' or 'chat'; vLLM's paths (/v1/completions, /v1/chat/completions) name them too."""
    return {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(value.rstrip("/"), value)


def cmd_serve(args) -> int:
    from treeserve.bench.run import BenchConfig, run_benchmark

    values = {name: getattr(args, name) for name in SERVE_OPTIONS}
    values["goodput"] = values["goodput"] or []
    values["output_len"] = values["output_len"] or [None]
    summary = run_benchmark(BenchConfig.from_dict(values))
    print(f"run directory: {args.out} ({written(args.out)})")
    return 0 if all(level["completed"] for level in summary["levels"]) else 1


def written(run_dir: str) -> str:
    """What the run directory holds, the plots counted (none under --no-plots)."""
    from pathlib import Path

    names = sorted(p.name for p in Path(run_dir).iterdir() if p.suffix != ".png")
    plots = sum(1 for _ in Path(run_dir).glob("*.png"))
    return ", ".join(names + ([f"{plots} plots"] if plots else []))


def cmd_report(args) -> int:
    from treeserve.bench.report import compare_runs, write_report

    if len(args.runs) == 1:
        print(write_report(args.runs[0]))
    else:
        print(compare_runs(args.runs, args.out))
    return 0


def cmd_sweep(args) -> int:
    from treeserve.bench.sweep import run_sweep

    return run_sweep(args.sweep_file)


def cmd_calibrate(args) -> int:
    from treeserve.bench.overhead import calibrate

    result = calibrate(args.out, args.port, args.ttft_ms, args.itl_ms, args.concurrency, args.num_requests,
                       args.output_len)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench throughput`'s options (treeserve.bench.offline; kept here so the parser needs no PyTorch)."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has fast bf16, else float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both engines run there)")
    parser.add_argument("--hf-batch-sizes", default="16,64", type=_counts,
                        help="HF static batch sizes to try; the fastest is the one compared against")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-bytes", type=int, default=2 << 30)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--tensor-parallel-size", default="1", type=_counts,
                        help="comma-separated ranks to run treeserve at (e.g. 1,2: each in turn, same workload)")
    parser.add_argument("--json", type=Path, help="also write the figures here")


def cmd_throughput(args) -> int:
    from treeserve.bench.offline import run

    return run(args)
