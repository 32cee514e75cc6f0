"""One engine, a list of jobs, in whichever virtualenv runs this file; `benchmarks/peers.py` starts it.

A job (JSON: {"name", "concurrency", "requests": [{"prompt_token_ids": [...], "max_tokens": n}]})
keeps at most `concurrency` requests in flight, submitting the next as one finishes; every
request's time counts from the job's start, so queueing is in it (as in the infrastructure paper).
Decoding is greedy with EOS ignored. Writes, per job, {"name", "concurrency", "elapsed_s",
"requests": [{"output_tokens", "ttft_s", "latency_s"}]}, with the engine's version, load time and
the process's peak RSS.
Only the standard library and the engine under test are imported, so each peer keeps its own
dependencies.

    python benchmarks/peer_worker.py --engine treeserve|vllm|hf|llamacpp --model DIR \
        --jobs JOBS.json --out RESULT.json [--dtype bfloat16] [--gguf FILE]
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

MAX_NUM_SEQS = 256  # the engines' batch bound: the highest concurrency the sweep asks for


class Clock:
    """First-token and finish times of each request, from one start."""

    def __init__(self, count: int):
        self.start = time.perf_counter()
        self.first = [None] * count
        self.done = [None] * count
        self.tokens = [0] * count

    def output(self, index: int, num_tokens: int, finished: bool) -> None:
        now = time.perf_counter() - self.start
        if num_tokens and self.first[index] is None:
            self.first[index] = now
        self.tokens[index] = num_tokens
        if finished:
            self.done[index] = now

    def result(self) -> dict:
        return {"elapsed_s": max(self.done),
                "requests": [{"output_tokens": n, "ttft_s": f, "latency_s": d}
                             for n, f, d in zip(self.tokens, self.first, self.done)]}


class Feeder:
    """Submits a job's requests, at most `concurrency` in flight: `submit(feeder, index, request)`."""

    def __init__(self, job: dict, submit):
        self.requests, self.limit, self.submit = job["requests"], job["concurrency"], submit
        self.next = self.in_flight = 0
        self.clock = Clock(len(self.requests))

    def top_up(self) -> None:
        while self.in_flight < self.limit and self.next < len(self.requests):
            self.submit(self, self.next, self.requests[self.next])
            self.next, self.in_flight = self.next + 1, self.in_flight + 1

    def output(self, index: int, num_tokens: int, finished: bool) -> None:
        self.clock.output(index, num_tokens, finished)
        self.in_flight -= finished

    @property
    def done(self) -> bool:
        return all(d is not None for d in self.clock.done)


def warm_up_prompt(args, jobs) -> list[int]:
    """The untimed request before the jobs: the first job's first prompt cut to 16 tokens, or whole
    with `--warm-up-whole` (so that the timed runs find the process's memory grown to their size:
    an engine's first long prompt faults its activations' pages in, ~20 ms of a 1k prefill here)."""
    prompt = jobs[0]["requests"][0]["prompt_token_ids"]
    return prompt if args.warm_up_whole else prompt[:16]


def run_treeserve(args, jobs) -> tuple[str, list[dict]]:
    import treeserve
    from treeserve import LLM, SamplingParams

    options = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    if args.speculative_config:
        options["speculative_config"] = json.loads(args.speculative_config)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=MAX_NUM_SEQS,
              kv_cache_memory_bytes=args.kv_gib << 30, enable_prefix_caching=False, **options)
    llm.generate([{"prompt_token_ids": warm_up_prompt(args, jobs)}],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    results = []
    for number, job in enumerate(jobs):
        def submit(feeder, index, item, number=number):
            params = SamplingParams(temperature=0.0, max_tokens=item["max_tokens"], ignore_eos=True)
            llm.loop.add_request(llm.engine, f"{number}-{index}", item["prompt_token_ids"], params,
                                 lambda out: feeder.output(index, len(out.outputs[0].token_ids), out.finished))
        feeder = Feeder(job, submit)
        while not feeder.done:
            feeder.top_up()
            llm.loop.step()
        results.append(feeder.clock.result() | _treeserve_spec_counts(llm.engine.stats()))
    return getattr(treeserve, "__version__", "dev"), results


def _treeserve_spec_counts(stats) -> dict:
    """The speculation counters so far (cumulative over the jobs)."""
    return {"spec_drafts": stats.spec_decode_num_drafts, "spec_draft_tokens": stats.spec_decode_num_draft_tokens,
            "spec_accepted_tokens": stats.spec_decode_num_accepted_tokens}


def run_vllm(args, jobs) -> tuple[str, list[dict]]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = {"speculative_config": json.loads(args.speculative_config)} if args.speculative_config else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False, seed=0,
              **options)
    llm.generate([TokensPrompt(prompt_token_ids=warm_up_prompt(args, jobs))],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    vllm_engine = llm.llm_engine
    results = []
    for number, job in enumerate(jobs):
        def submit(feeder, index, item, number=number):
            params = SamplingParams(temperature=0.0, max_tokens=item["max_tokens"], ignore_eos=True)
            prompt = TokensPrompt(prompt_token_ids=item["prompt_token_ids"])
            vllm_engine.add_request(f"{number}-{index}", prompt, params)
        feeder = Feeder(job, submit)
        while not feeder.done:
            feeder.top_up()
            for out in vllm_engine.step():
                feeder.output(int(out.request_id.split("-")[1]), len(out.outputs[0].token_ids), out.finished)
        results.append(feeder.clock.result())
    return vllm.__version__, results


def run_hf(args, jobs) -> tuple[str, list[dict]]:
    """Static batching: batches of `concurrency` in arrival order, each decoded to its longest output."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    results = []
    for job in jobs:
        requests, size = job["requests"], job["concurrency"]
        clock = Clock(len(requests))
        for first in range(0, len(requests), size):
            batch = requests[first:first + size]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch])
            mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                                 for r in batch])
            longest = max(r["max_tokens"] for r in batch)
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                               min_new_tokens=longest, pad_token_id=0)
            for offset, item in enumerate(batch):  # a request's tokens arrive when its batch returns
                clock.output(first + offset, item["max_tokens"], True)
        results.append(clock.result())
    return transformers.__version__, results


def run_llamacpp(args, jobs) -> tuple[str, list[dict]]:
    """llama-cpp-python's `Llama` decodes one sequence at a time: every job runs at concurrency 1."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.max_model_len, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, verbose=False, seed=0)
    results = []
    for job in jobs:
        clock = Clock(len(job["requests"]))
        for i, item in enumerate(job["requests"]):
            count = 0
            for _ in llm.generate(item["prompt_token_ids"], top_k=1, temp=0.0, reset=True):
                count += 1
                clock.output(i, count, count == item["max_tokens"])
                if count == item["max_tokens"]:
                    break
        results.append(clock.result())
    return llama_cpp.__version__, results


RUNNERS = {"treeserve": run_treeserve, "vllm": run_vllm, "hf": run_hf, "llamacpp": run_llamacpp}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--model", required=True)
    parser.add_argument("--jobs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", help="llama.cpp: the model converted to GGUF")
    parser.add_argument("--max-num-batched-tokens", type=int, help="treeserve: the step's token budget "
                        "(default: the engine's)")
    parser.add_argument("--speculative-config", help="treeserve and vllm: speculative decoding, vLLM's JSON dict")
    parser.add_argument("--warm-up-whole", action="store_true", help="treeserve and vllm: warm up with the first "
                        "job's first prompt whole (default: its first 16 tokens)")
    args = parser.parse_args()
    jobs = json.loads(args.jobs.read_text())
    start = time.perf_counter()
    version, results = RUNNERS[args.engine](args, jobs)
    total = time.perf_counter() - start
    for job, result in zip(jobs, results):
        result |= {"name": job["name"], "concurrency": job["concurrency"]}
    load = total - sum(r["elapsed_s"] for r in results)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux
    args.out.write_text(json.dumps({"engine": args.engine, "version": version, "load_s": load, "jobs": results,
                                    "peak_rss_bytes": peak_rss}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
