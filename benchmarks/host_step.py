"""The host's share of a decode step: what the engine's Python does for one step of many sequences
when the device's work costs nothing (#59 item 3: a GPU decode step at batch 64 is the host's time).

The model's forward pass is stubbed (it returns zero hidden states of the right shape), so what is
timed is scheduling, building the step, the runner's inputs and attention metadata (the Triton
backend's, copied into the static buffers that CUDA graphs replay), sampling the tiny vocabulary,
and output processing. Each step is timed in thread CPU time (`time.thread_time`: what the engine's
thread spent, not what another process took), one torch thread, async scheduling on as on CUDA.

    python benchmarks/host_step.py --batch 64 --context 1024 --steps 200 --repeats 5
    python benchmarks/host_step.py --profile      # cProfile's top functions of one run
    python benchmarks/host_step.py --outputs cumulative   # outputs that hold everything so far
    python benchmarks/host_step.py --sampling seeded      # temperature 1, a seed a request (a search's samples)

`--outputs`: what each request's RequestOutputs hold: `delta` (the default: what the server's
streamed requests take), `cumulative` (non-streamed server requests) or `final` (offline callers).

It prints the median of the repeats' per-step medians (ms); compare two versions of the code by
running this alternately on each (a `git worktree` of the other), as the machine drifts.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend's metadata on CPU (its kernels never run)

from treeserve.config import EngineConfig
from treeserve.engine.cuda_graphs import DecodeGraphs
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.model.random_models import make_tiny_model
from treeserve.model.transfer import StepStaging
from treeserve.sampling_params import RequestOutputKind, SamplingParams

OUTPUT_KINDS = {  # what each request's outputs hold
    "delta": RequestOutputKind.DELTA,            # only the new token and text, per step (the server's streams)
    "cumulative": RequestOutputKind.CUMULATIVE,  # everything so far, per step (non-streamed server requests)
    "final": RequestOutputKind.FINAL_ONLY,       # one output at the end (offline callers, search)
}

SAMPLING = {  # how request i samples
    "greedy": lambda i: {"temperature": 0.0},
    "seeded": lambda i: {"temperature": 1.0, "seed": i},  # a search's samples: each with its own seed
}


def step_tokens(context: int) -> int:
    return max(2048, context)


def output_tokens(batch: int, context: int, steps: int) -> int:
    """Each request's max_tokens: the first requests decode while the last ones prefill, so none may
    end before the last timed step."""
    return steps + -(-batch * context // step_tokens(context)) + 16


def max_model_len(batch: int, context: int, steps: int) -> int:
    return context + output_tokens(batch, context, steps) + 16


def engine(model_dir: Path, batch: int, context: int, steps: int) -> LLMEngine:
    length = max_model_len(batch, context, steps)
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", attention_backend="triton",
                          max_num_seqs=batch, max_num_batched_tokens=step_tokens(context), async_scheduling=True,
                          async_output_processing=True, max_model_len=length,
                          kv_cache_memory_bytes=batch * length * 2 * 2 * 32 * 4 + (64 << 20))
    eng = LLMEngine.from_config(config)
    _stub_forward(eng)
    _static_buffers(eng, batch)
    eng.runner.staging = StepStaging(eng.device, always=True)  # (the CUDA path's host copies; pinning aside)
    return eng


def _stub_forward(eng: LLMEngine) -> None:
    """The model's forward pass returns stored random hidden states at once, a different window each
    call, so that the real logits head picks varied, mostly plain tokens (all-zero states would pick
    one token, a special one here, whose skipped text is not what a served model writes)."""
    model = eng.runner.model
    rows = eng.config.max_num_batched_tokens + 256
    hidden = torch.randn(2 * rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = [0]

    def forward(input_ids, positions, kv_caches, meta):
        calls[0] = (calls[0] + 7) % rows
        return hidden[calls[0]:calls[0] + input_ids.shape[0]]

    model.forward = forward


def _static_buffers(eng: LLMEngine, batch: int) -> None:
    """The CUDA-graph path's static buffers (their copies are host work on CUDA), run eagerly."""
    runner = eng.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, batch, -(-eng.max_model_len // eng.config.block_size),
                          torch.device("cpu"), use_graphs=False)
    graphs.capture()
    runner.graphs = graphs


def run_once(eng: LLMEngine, batch: int, context: int, steps: int, outputs: str, tag: str,
             sampling: str = "greedy") -> list[float]:
    """Per-step thread CPU seconds of `steps` decode steps of `batch` sequences of `context` tokens,
    each step through the engine loop (which hands each output to its request's callback, as the
    server's)."""
    loop = EngineLoop.of(eng)
    vocab = eng.runner.model.config.vocab_size
    received = []
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % (vocab - 10) + 5 for j in range(context)]
        params = SamplingParams(max_tokens=output_tokens(batch, context, steps), ignore_eos=True,
                                output_kind=OUTPUT_KINDS[outputs], **SAMPLING[sampling](i))
        loop.add_request(eng, f"{tag}-{i}", prompt, params, received.append)
    settled = 0
    while settled < 4:  # the prefills, then into the steady state (async scheduling's pipeline full)
        if not loop.step():
            raise RuntimeError("the requests ended before every one of them was decoding")
        settled = settled + 1 if eng.last_step_num_tokens == batch else 0  # (`batch` tokens: every request decodes)
    times = []
    for _ in range(steps):
        start = time.thread_time()
        loop.step()
        times.append(time.thread_time() - start)
        if eng.last_step_num_tokens != batch:
            raise RuntimeError(f"a timed step ran {eng.last_step_num_tokens} tokens, not one for each of {batch} requests")
    while loop.has_unfinished_requests():
        loop.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--outputs", choices=tuple(OUTPUT_KINDS), default="delta")
    parser.add_argument("--sampling", choices=tuple(SAMPLING), default="greedy",
                        help="greedy, or seeded (temperature 1, a seed a request, as a search's samples)")
    parser.add_argument("--profile", action="store_true", help="cProfile one run and print its top functions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=max_model_len(args.batch, args.context, args.steps))
        eng = engine(model_dir, args.batch, args.context, args.steps)
        run_once(eng, args.batch, args.context, 20, args.outputs, "warm", args.sampling)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_once(eng, args.batch, args.context, args.steps, args.outputs, "profiled", args.sampling)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            return
        medians = []
        for r in range(args.repeats):
            times = run_once(eng, args.batch, args.context, args.steps, args.outputs, f"r{r}", args.sampling)
            medians.append(statistics.median(times) * 1e3)
            print(f"repeat {r + 1}: median {medians[-1]:.3f} ms a step (min {min(times) * 1e3:.3f})", flush=True)
        print(f"host time a decode step, batch {args.batch}, context {args.context}, {args.outputs} outputs, "
              f"{args.sampling} sampling: "
              f"{statistics.median(medians):.3f} ms (median of {args.repeats} repeats' medians)")


if __name__ == "__main__":
    main()
