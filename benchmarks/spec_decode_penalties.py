"""Speculation for penalized requests: `ngram` drafts under repetition_penalty=1.1, the code before
(where a penalized request got no drafts: `--before-src`, another checkout's `src`) against this
checkout's, each run in a fresh process, alternating.

Workload: the bundled generator (builtin:arith-gen, dtype auto), greedy chat answers to the
arithmetic task's test questions one at a time, repetition_penalty=1.1 (a chat UI's common setting).
Its answers restate the question's numbers and the format's sentences: repetitive text that prompt
lookup drafts from. Prints tok/s of output and acceptance per run, and whether every run's tokens
equal the first's.

    python benchmarks/spec_decode_penalties.py --before-src /path/to/main/src [--passes 2] [--questions 24]

`--fields` replaces the sampling settings (JSON, default {"repetition_penalty": 1.1}): with
'{"bad_words": ["Step"]}' the n-gram drafts often propose the banned " Step" (the question and the
answer so far say it), which the request's processing forbids: drafts cut there (session 81) against
drafts verified past it; `--speculative-config` replaces the n-gram drafting (JSON: a draft model,
'{"method": "draft_model", "model": "builtin:arith-gen", "num_speculative_tokens": 4}').
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
WARM_QUESTIONS = 4
HERE = Path(__file__).resolve().parent


def worker(questions: int, fields: dict, speculative_config: dict) -> None:
    """One engine: warm-up, then the timed answers; one JSON line on stdout."""
    from treeserve import LLM, SamplingParams
    from treeserve.tasks.arithmetic import generate

    rows = [p.row() for p in generate("test", WARM_QUESTIONS + questions, seed=0)]
    chats = [[{"role": "user", "content": r["problem"]}] for r in rows]
    params = SamplingParams(temperature=0, max_tokens=256, **fields)
    llm = LLM("builtin:arith-gen", speculative_config=speculative_config)
    for chat in chats[:WARM_QUESTIONS]:
        llm.chat([chat], params, use_tqdm=False)
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = [llm.chat([chat], params, use_tqdm=False)[0] for chat in chats[WARM_QUESTIONS:]]
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    ids = [o.outputs[0].token_ids for o in outputs]
    print(json.dumps({"tok_s": sum(map(len, ids)) / seconds, "tokens": ids,
                      "drafted": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                      "accepted": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens}))


def run(src: Path, questions: int, fields: str, speculative_config: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--worker", "--questions", str(questions), "--fields", fields,
                          "--speculative-config", speculative_config], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-src", type=Path, help="the `src` of a checkout from before (no drafts)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--fields", default='{"repetition_penalty": 1.1}', help="the sampling settings (JSON)")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM), help="how it drafts (JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.questions, json.loads(args.fields), json.loads(args.speculative_config))
        return 0
    srcs = {"before": args.before_src, "after": HERE.parent / "src"}
    runs, first = {name: [] for name in srcs}, None
    for _ in range(args.passes):
        for name, src in srcs.items():
            result = run(src, args.questions, args.fields, args.speculative_config)
            first = first if first is not None else result["tokens"]
            runs[name].append(result["tok_s"])
            kept = f"{result['accepted']}/{result['drafted']}" if result["drafted"] else "0/0"
            print(f"{name:6s} {result['tok_s']:7.1f} tok/s  accepted {kept} draft tokens  "
                  f"tokens identical: {result['tokens'] == first}", flush=True)
    ratio = statistics.median(a / b for a, b in zip(runs["after"], runs["before"]))
    print(f"after / before: {ratio:.2f}x (median of the passes' ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
