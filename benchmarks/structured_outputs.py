"""The grammar mask's cost against the decode step it runs in (structured outputs).

Runs a decode batch on the ~150M benchmark model (`treeserve.bench.offline`, dtype auto), half of
the requests constrained by a JSON schema (llguidance), half free, and times every engine step and,
inside it, the mask: each constrained row's allowed-token bitmask (`structured_outputs.bitmask`,
computed where the step is built) and its application to the batch's logits in the sampler
(`structured_outputs.apply_bitmask`). Prints the median decode step and mask times over the
steps with the full batch and their ratio; then the same batch with no constrained row, for the
step time without any mask.

    python benchmarks/structured_outputs.py [--batch 64] [--steps 24] [--dtype auto]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from treeserve import LLM, SamplingParams, StructuredOutputsParams
from treeserve.bench.offline import benchmark_model_dir
from treeserve.engine import structured_outputs

# Long outputs that stay in the grammar: an array of small objects, so most steps sit inside
# strings, numbers or between keys, where the mask has the most to compute.
SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "value"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "value": {"type": "integer"}}}}


class StepTimer:
    """Wall time of each engine step, and of the mask inside it."""

    def __init__(self, engine):
        self.steps: list[tuple[int, int, float, float]] = []  # (rows, constrained rows, step s, mask s)
        self._mask_s, self._constrained = 0.0, 0
        real_bitmask, real_apply, real_step = structured_outputs.bitmask, structured_outputs.apply_bitmask, engine.step

        def timed_bitmask(matchers, vocab_size):
            start = time.perf_counter()
            out = real_bitmask(matchers, vocab_size)
            self._mask_s += time.perf_counter() - start
            self._constrained = len(matchers)
            return out

        def timed_apply(logits, rows, bitmask):
            start = time.perf_counter()
            real_apply(logits, rows, bitmask)
            self._mask_s += time.perf_counter() - start

        def timed_step():
            self._mask_s, self._constrained = 0.0, 0
            start = time.perf_counter()
            outputs = real_step()
            self.steps.append((engine.last_step_num_tokens, self._constrained, time.perf_counter() - start,
                               self._mask_s))
            return outputs
        structured_outputs.bitmask, structured_outputs.apply_bitmask = timed_bitmask, timed_apply
        engine.step = timed_step


def run(llm: LLM, timer: StepTimer, batch: int, steps: int, constrained: int) -> list[tuple[int, int, float, float]]:
    timer.steps = []
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=steps, ignore_eos=True,
                             structured_outputs=spec if i < constrained else None) for i in range(batch)]
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(64)]} for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)
    return [s for s in timer.steps if s[0] == batch]  # decode steps with every request in the batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24, help="tokens generated per request")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(str(benchmark_model_dir()), dtype=args.dtype, device="cpu")
    llm.engine.compile_grammar(StructuredOutputsParams(json=SCHEMA))
    timer = StepTimer(llm.engine)
    run(llm, timer, args.batch, 4, args.batch // 2)  # warm-up: kernels built, caches touched
    half = run(llm, timer, args.batch, args.steps, args.batch // 2)
    free = run(llm, timer, args.batch, args.steps, 0)
    if not half or not free:
        raise SystemExit("no decode step held the whole batch: raise --steps")
    step_ms = statistics.median(s[2] for s in half) * 1e3
    mask_ms = statistics.median(s[3] for s in half) * 1e3
    free_ms = statistics.median(s[2] for s in free) * 1e3
    print(f"model {benchmark_model_dir().name}, {llm.engine.dtype}, {torch.get_num_threads()} threads; "
          f"decode batch {args.batch}, {args.batch // 2} constrained by a JSON schema; {len(half)} steps")
    print(f"decode step: {step_ms:.1f} ms (median); mask inside it: {mask_ms:.2f} ms; "
          f"mask / step: {mask_ms / step_ms:.3f}")
    print(f"the same batch with no constrained row: {free_ms:.1f} ms a step; "
          f"constrained / free step: {step_ms / free_ms:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
