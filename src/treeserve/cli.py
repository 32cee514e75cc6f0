"""`treeserve` command line."""
from __future__ import annotations

import argparse
import sys

from treeserve.arg_types import at_least_one, broker_url, json_list, json_object, model_arg, port, served_name
from treeserve.cli_gateway import add_gateway_parsers
from treeserve.cli_gateway import main as gateway_main
from treeserve.lifecycle import exit_now, exit_on_signals, follow_parent, heap_frozen_while_it_runs


def _add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """`several_models`: the server's arguments (several models, the serving token budget)."""
    from treeserve.model.registry import DEFAULT_GENERATOR

    if several_models:
        parser.add_argument("--model", action="append", type=model_arg,
                            help="NAME=PATH, repeatable: several models on one device (routed by 'model'); a "
                            "bare builtin:NAME is named NAME")
    else:
        parser.add_argument("--model", default=DEFAULT_GENERATOR, type=model_arg, help="local HF directory or builtin:NAME")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--generation-config", default="auto",
                        help="auto: the model's generation_config.json sets the default sampling (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens) of requests that leave it out; "
                        "vllm: treeserve's defaults; or a folder whose generation_config.json is read instead")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    if several_models:
        parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="tokens per engine step (default: on CPU by model size, 256-2048, so a step's "
                            "work stays bounded and prompts finish sooner under load; 2048 on CUDA)")
    else:
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: the share of the device's memory the models may use, KV blocks included "
                        "(unless --kv-cache-memory-bytes says how much KV)")
    parser.add_argument("--quantization", "-q", help="int8: weight-only int8 made at load, on CPU; gptq, awq, "
                        "compressed-tensors: the checkpoint's own (default: what the checkpoint's "
                        "quantization_config says; none: the weights as stored)")
    parser.add_argument("--speculative-config", type=json_object, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (methods: ngram, suffix, draft_model with "model": a smaller checkpoint '
                        'with the same tokenizer, eagle and eagle3 with "model": an EAGLE head for this model; '
                        '"disable_by_batch_size": N turns it off '
                        'while N requests run)')
    parser.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                        help="auto: on CPU an untied embedding is read in place from the checkpoint file, its rows "
                        "as tokens need them (rewriting that file under a running server can crash it, as with "
                        "llama.cpp's mmap); safetensors: every weight copied into memory; dummy: random weights")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of prompts' shared prefixes")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="the same as --no-enable-prefix-caching")
    parser.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto",
                        help="auto: Triton kernels on CUDA, PyTorch (and treeserve's C kernels) on CPU; "
                        "or TREESERVE_ATTENTION_BACKEND")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and launch each step before the previous one's tokens reach the host "
                        "(default: on for CUDA without tensor parallelism)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split each model over this many ranks (processes; one GPU each on CUDA)")
    parser.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                        help="mp: worker processes on this machine")
    parser.add_argument("--threads-per-rank", type=int, help="CPU: torch threads per rank (default: cores / ranks)")


def _engine_options(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes, block_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching, attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                quantization=args.quantization, speculative_config=args.speculative_config,
                load_format=args.load_format, generation_config=args.generation_config, **parallel_options(args))


def parallel_options(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend, threads_per_rank=args.threads_per_rank)


def cmd_run(args) -> int:
    from treeserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed, n=args.n)
    prompts = args.prompt or ["Hello"]
    with heap_frozen_while_it_runs():
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            print(f"--- prompt: {prompt!r} [{len(output.prompt_token_ids)} tokens]")
            print(completion.text)
            print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    return 0


def _add_serving_args(parser: argparse.ArgumentParser, http: bool) -> None:
    """`serve`'s arguments; a worker has them all but the address (it takes requests from a broker)."""
    _add_engine_args(parser, several_models=True)
    parser.add_argument("--kv-mode", choices=["shared", "static"], default="shared",
                        help="with several models: one shared KV arena, or an equal static split")
    parser.add_argument("model_path", nargs="?", type=model_arg, help="model directory or builtin:NAME (served as NAME; default: "
                        "the bundled arith-gen generator and arith-prm verifier, served under those names)")
    if http:
        _add_http_args(parser)
    parser.add_argument("--api-key", action="append", help="required bearer key (repeatable; or TREESERVE_API_KEY)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM or SIGINT, seconds the requests in flight (streams and searches too) may "
                        "take to finish while new ones get 503 and /health/ready turns 503; a second signal "
                        "exits at once")
    parser.add_argument("--served-model-name", type=served_name, help="the name requests give as 'model' (default: NAME for "
                        "builtin:NAME, else the model argument as given)")
    parser.add_argument("--verifier", action="append", metavar="NAME[=RECIPE]",
                        help="serve the model NAME as a process reward model (a search's verifier, /v1/rewards), "
                        "read by RECIPE (default: the one its config.json names, else rlhflow); repeatable. A model "
                        "with a reward head or a prm_recipe in its config.json is one without it (the bundled "
                        "arith-prm); a plain language model is not: RLHFlow's PRMs declare nothing")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (vLLM's: prompt and generation throughput, requests running "
                        "and waiting, KV cache usage, prefix cache hit rate per model, every "
                        "TREESERVE_LOG_STATS_INTERVAL seconds, 10 by default)")
    parser.add_argument("--max-queue", type=at_least_one, help="waiting requests (or queued searches) beyond which "
                        "new ones get 429")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the random numbers set when the models "
                        "load, which requests without a 'seed' draw from (one with its own seed is unaffected)")
    parser.add_argument("--max-problems-in-flight", type=int, default=32,
                        help="search problems that advance together, from all requests; more wait in a queue")
    parser.add_argument("--chat-template", help="a Jinja chat template (a file, or the text) replacing the "
                        "models' own (examples/ has tool-calling ones)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a request's own chat_template (vLLM's flag: a template is code the server runs, "
                        "in Jinja's sandbox); without it such a request is a 400 naming chat_template")
    parser.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"],
                        help="the format the model writes tool calls in: read from its output (tool_choice auto) "
                        "and forced by grammar (required, a named function)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide to call tools (tool_choice "auto", the default with tools); '
                        "needs --tool-call-parser")


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    """`serve`'s address and HTTP server (uvicorn) flags."""
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every IPv4 "
                        "address; ::, every IPv6 one; ::1, IPv6's loopback)")
    parser.add_argument("--port", type=port, default=8000)
    parser.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                        default="info", help="uvicorn's log level")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no line per request in uvicorn's access log")
    parser.add_argument("--allowed-origins", type=json_list, default=None,
                        help='CORS: the origins a browser page may call from, a JSON list as vLLM takes it '
                        '(\'["*"]\' any; default: none, no CORS headers: vLLM allows every origin by default)')
    parser.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS: the methods allowed (JSON list)")
    parser.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS: the headers allowed (JSON list)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="every answer carries X-Request-Id (the request's own X-Request-Id if it sent one, "
                        "else a new uuid4 hex; the openai client's _request_id), as vLLM's flag does; off by default")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each chat or completion request as vLLM does: 'Received request ID: prompt: ..., "
                        "params: ...', then 'Finished request ID.' or 'Aborted request ID.' (off by default, as in "
                        "vLLM; uvicorn's access log, a line per HTTP request, is --disable-uvicorn-access-log)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="taken for older vLLM command lines; requests are not logged unless --enable-log-requests")


def build_parser() -> argparse.ArgumentParser:
    from treeserve.bench.cli_bench import add_bench_parsers
    from treeserve.cli_search import add_search_parsers
    from treeserve.tasks.cli_tasks import add_tasks_parsers

    from treeserve.cli_help import Parser

    parser = Parser(prog="treeserve", description="LLM inference and test-time search runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate text for one or more prompts")
    _add_engine_args(run)
    run.add_argument("prompt", nargs="*", help="the prompts (default: 'Hello'); with --chat each is a user message")
    run.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int)
    run.add_argument("-n", "--n", type=int, default=1, help="samples per prompt")
    run.set_defaults(func=cmd_run)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_serving_args(serve, http=True)
    serve.set_defaults(func=cmd_serve)
    worker = sub.add_parser("worker", help="a model server fed by a message broker (behind `treeserve gateway`)")
    _add_serving_args(worker, http=False)
    worker.add_argument("--broker", required=True, type=broker_url, help="AMQP URL of the RabbitMQ broker, e.g. amqp://guest:guest@host/")
    worker.add_argument("--prefetch", type=int, default=64, help="requests this worker holds at once")
    worker.set_defaults(func=cmd_worker)
    memory = sub.add_parser("memory", help="print the memory breakdown per model (weights, activations, KV)")
    memory.add_argument("--model", action="append", type=model_arg, help="NAME=PATH (repeatable) or a single PATH")
    memory.add_argument("--kv-mode", choices=["shared", "static"], default="shared")
    memory.add_argument("--kv-fraction", action="append", help="NAME=FRACTION for --kv-mode static")
    memory.add_argument("--kv-cache-memory-bytes", type=int, help="KV budget for all models together")
    memory.add_argument("--memory-utilization", type=float, help="the share of memory (CPU: available host memory, "
                        "default 0.25; CUDA: the device's, default 0.9) for weights, activations and KV together")
    memory.add_argument("--cpu-kv-memory-fraction", type=float, help="CPU: the share of available host memory for "
                        "KV alone, as LLM(...)'s (instead of --memory-utilization)")
    memory.add_argument("--dtype", default="auto")
    memory.add_argument("--device", default="auto")
    memory.add_argument("--max-model-len", type=int)
    memory.add_argument("--max-num-batched-tokens", type=int, default=2048)
    memory.set_defaults(func=cmd_memory)
    add_search_parsers(sub)
    add_bench_parsers(sub)
    add_tasks_parsers(sub)
    add_gateway_parsers(sub)
    return parser


def cmd_memory(args) -> int:
    from treeserve.model.registry import named_models
    from treeserve.runtime.memory import format_breakdown
    from treeserve.runtime.runtime import Runtime

    fractions = _kv_fractions(args.kv_fraction) if args.kv_fraction else None
    rt = Runtime(named_models(args.model), kv_mode=args.kv_mode, kv_fractions=fractions,
                 kv_cache_memory_bytes=args.kv_cache_memory_bytes, memory_utilization=args.memory_utilization,
                 cpu_kv_memory_fraction=args.cpu_kv_memory_fraction, dtype=args.dtype, device=args.device,
                 max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens)
    shared = " (one arena: the KV column is the whole shared arena)" if rt.kv_mode == "shared" else ""
    print(f"KV mode: {rt.kv_mode}{shared}; KV budget {rt.kv_budget / (1 << 20):,.1f} MiB")
    print(format_breakdown(list(rt.memory.values()), rt.total_bytes, rt.utilisation))
    return 0


def _kv_fractions(values: list[str]) -> dict[str, float]:
    """--kv-fraction NAME=FRACTION, repeatable (`x` was "could not convert string to float: ''")."""
    fractions = {}
    for value in values:
        name, sep, fraction = value.partition("=")
        try:
            fractions[name] = float(fraction)
        except ValueError:
            fractions[name] = None
        if not sep or not name or fractions[name] is None:
            raise ValueError(f"--kv-fraction: expected NAME=FRACTION (e.g. gen=0.6), got {value!r}")
    return fractions


def cmd_worker(args) -> int:
    from treeserve.server.launch import worker

    return worker(args)


def cmd_serve(args) -> int:
    from treeserve.server.launch import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    follow_parent()  # a child of `treeserve chat` (or another command) ends with it
    exit_on_signals(service=_is_service(argv))  # SIGTERM and SIGINT: cleanup runs (status 0, or 128 + signal)
    if argv[:1] in (["gateway"], ["chat"]):
        return gateway_main(argv)  # the gateway imports no engine (nor PyTorch); chat runs one in a child
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # (a file missing or in the way, a directory not writable, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 2


# Long-running servers: once they have stopped (their children too), the process ends without the
# interpreter's teardown (lifecycle.exit_now).
QUICK_EXIT = {"serve", "worker", "gateway", "chat"}


def _is_service(argv: list[str]) -> bool:
    """A long-running command, which a signal ends as it should (status 0): the servers and `bench
    sweep`; another command (search, eval, run, ...) a signal cuts short (status 128 + signal)."""
    return bool(argv) and (argv[0] in QUICK_EXIT or argv[:2] == ["bench", "sweep"])


def run() -> None:
    """The `treeserve` command (and `python -m treeserve.cli`)."""
    argv = sys.argv[1:]
    try:
        code = main(argv)
    except SystemExit as exc:  # (SIGTERM or SIGINT before a server took the signals over)
        if not isinstance(exc.code, int | None):
            raise
        code = exc.code or 0
    if argv[:1] and argv[0] in QUICK_EXIT:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
