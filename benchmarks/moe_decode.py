"""Mixture-of-experts decode on this CPU: treeserve against HF transformers (static batching) and
vLLM's CPU build, same run, alternating, each engine in a fresh process (benchmarks/peer_worker.py).

The model: a random Mixtral (8 experts, top 2; hidden 512, 1,024 per expert, 4 layers, 8/2 heads of
64, vocabulary 8,192), written by transformers' own class. The job: 64 requests of 32 prompt tokens
and 128 output tokens (EOS ignored, greedy) all at once, so nearly every step decodes a batch of 64.
Prints output tokens/s per engine (median over `--pairs`) and the ratios; vLLM is reported with
the reason where it cannot be installed or does not load the model.

    python benchmarks/moe_decode.py [--dtype float32|bfloat16] [--pairs 3] [--peers hf,vllm] [--setup]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402

from treeserve.model.random_models import make_tiny_model  # noqa: E402
from treeserve.model.registry import cache_dir  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024, num_local_experts=8,
             num_experts_per_tok=2, initializer_range=0.02)


def model_dir() -> Path:
    path = cache_dir() / "bench-models" / "mixtral-8x-top2-v1"
    if not (path / "config.json").is_file():
        make_tiny_model("mixtral", path, seed=0, **SHAPE)
    return path


def decode_job(batch: int, prompt: int, output: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    requests = [{"prompt_token_ids": [rng.randrange(10, SHAPE["vocab_size"]) for _ in range(prompt)],
                 "max_tokens": output} for _ in range(batch)]
    return [{"name": f"decode-b{batch}", "concurrency": batch, "requests": requests}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--peers", default="hf,vllm")
    parser.add_argument("--setup", action="store_true", help="install a peer's virtualenv where it is missing")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench_out/moe_decode"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, jobs = model_dir(), decode_job(args.batch, 32, args.output_tokens)
    engines = {"treeserve": (peers.TREESERVE, peers.TREESERVE.python(False))}
    unavailable = {}
    for name in filter(None, args.peers.split(",")):  # --peers "": treeserve alone
        try:
            engines[name] = (peers.PEERS[name], peers.PEERS[name].python(args.setup))
        except peers.PeerUnavailable as exc:
            unavailable[name] = str(exc)
    figures: dict[str, list[float]] = {name: [] for name in engines}
    for pair in range(args.pairs):
        order = list(engines) if pair % 2 == 0 else list(reversed(engines))
        for name in order:
            if name in unavailable:
                continue
            peer, python = engines[name]
            try:
                result = peers.run_worker(peer, python, model, jobs, args.out, args.dtype)
            except RuntimeError as exc:
                unavailable[name] = str(exc)[:400]
                continue
            figures[name].append(peers.output_tok_s(result["jobs"][0]))
            print(f"pair {pair + 1}: {name} {figures[name][-1]:,.0f} output tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in figures.items() if v}
    print(f"\nMixtral-shaped MoE (8 experts, top 2), {args.dtype}, decode at batch {args.batch} "
          f"({args.output_tokens} tokens each), median of {args.pairs}:")
    for name, value in medians.items():
        ratio = "" if name == "treeserve" else f"  treeserve / {name} = {medians['treeserve'] / value:.2f}x"
        print(f"  {name:10s} {value:10,.0f} output tok/s{ratio}")
    for name, reason in unavailable.items():
        print(f"  {name}: not measured: {reason}")
    (args.out / "moe_decode.json").write_text(json.dumps({"dtype": args.dtype, "tok_s": figures,
                                                          "unavailable": unavailable}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
