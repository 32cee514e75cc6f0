"""bfloat16 linears on CPU: `F.linear`, oneDNN's packed layout (`PackedLinear`) and treeserve's own
(`Bf16Linear`, csrc/bf16_linear.c), in treeserve.model.packed_linear.

Two views. Per call: each of the benchmark model's layer shapes for a range of rows (a decode
step's rows are its batch), weights in cache, microseconds per call and whether each result equals
`F.linear`'s bit for bit (or the share of elements that differ). Per step: every linear of one step
of the ~150M benchmark model (14 layers and the LM head, 242 MB of weights, so read from memory as
in serving), ms per step for oneDNN's layout and ours, alternating, medians, with the weights' read
rate and GFLOP/s.

    python benchmarks/packed_linear.py [--rows 1,8,24,64,256,1024] [--step-rows 1,4,8,16,32,64,128,512,2048]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from treeserve.model.packed_linear import Bf16Linear, PackedLinear, bf16_kernel, can_pack

# (in, out) of the ~150M benchmark model's layers: qkv, o, gate+up, down, lm_head
SHAPES = [(768, 1280), (768, 768), (768, 4608), (2304, 768), (768, 32000)]
LAYERS = 14


def per_call_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def per_call(rows_list: list[int], repeats: int, ours: bool) -> None:
    print(f"{'in x out':>12}{'rows':>6}{'F.linear us':>13}{'oneDNN us':>11}{'ours us':>9}"
          "  oneDNN identical, ours differing")
    for k, n in SHAPES:
        linear = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        packed = PackedLinear(linear)
        mine = Bf16Linear(linear) if ours else None
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            with torch.inference_mode():
                plain_us = per_call_us(lambda: linear(x), repeats)
                packed_us = per_call_us(lambda: packed(x), repeats)
                mine_us = per_call_us(lambda: mine(x), repeats) if mine else float("nan")
                same = torch.equal(linear(x), packed(x))
                differ = float((mine(x) != linear(x)).double().mean()) if mine and rows else float("nan")
            print(f"{f'{k}x{n}':>12}{rows:>6}{plain_us:>13.1f}{packed_us:>11.1f}{mine_us:>9.1f}  {same}, {differ:.2%}")


def step_ms(layers: list[list[nn.Module]], head: nn.Module, rows: int, repeats: int) -> float:
    """Median ms of one step's linears over `rows` rows (each layer's weights once)."""
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for k, _ in SHAPES}}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            start = time.perf_counter()
            for layer in layers:
                for (k, _), linear in zip(SHAPES, layer):
                    linear(xs[k])
            head(xs[SHAPES[-1][0]])
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def per_step(rows_list: list[int], repeats: int, rounds: int) -> None:
    torch.manual_seed(0)
    weights = [[(torch.randn(n, k) * 0.05).to(torch.bfloat16) for k, n in SHAPES[:-1]] for _ in range(LAYERS)]
    head_weight = (torch.randn(SHAPES[-1][1], SHAPES[-1][0]) * 0.05).to(torch.bfloat16)
    onednn = ([[PackedLinear.of_weight(w) for w in layer] for layer in weights], PackedLinear.of_weight(head_weight))
    ours = ([[Bf16Linear.of_weight(w) for w in layer] for layer in weights], Bf16Linear.of_weight(head_weight))
    weight_bytes = 2 * (LAYERS * sum(k * n for k, n in SHAPES[:-1]) + head_weight.numel())
    print(f"\none step's linears: {LAYERS} layers and the LM head, {weight_bytes / 1e6:.0f} MB of bfloat16 "
          f"weights; medians of {rounds} alternating rounds")
    print(f"{'rows':>6}{'oneDNN ms':>11}{'GB/s':>7}{'GFLOP/s':>9}"
          f"{'ours ms':>9}{'GB/s':>7}{'GFLOP/s':>9}{'speed-up':>10}")
    for rows in rows_list:
        pairs = [(step_ms(*onednn, rows, repeats), step_ms(*ours, rows, repeats)) for _ in range(rounds)]
        a, b = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        flop = weight_bytes * rows  # 2 flops per weight per row, 2 bytes per weight
        print(f"{rows:>6}{a:>11.2f}{weight_bytes / a / 1e6:>7.1f}{flop / a / 1e6:>9.0f}"
              f"{b:>9.2f}{weight_bytes / b / 1e6:>7.1f}{flop / b / 1e6:>9.0f}{a / b:>10.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,24,64,256,1024", help="per call: rows ('' to skip)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--step-rows", default="1,4,8,16,32,64,128,512,2048", help="per step: rows ('' to skip)")
    parser.add_argument("--step-repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        print("this CPU has no fast bfloat16 (AVX512-BF16 or AMX), or torch has no oneDNN: nothing is packed here")
        return 0
    ours = bf16_kernel() is not None
    if not ours:
        print("treeserve's bfloat16 kernel does not run here (no AVX512-BF16 or no C compiler): oneDNN only")
    if args.rows:
        per_call([int(r) for r in args.rows.split(",")], args.repeats, ours)
    if args.step_rows and ours:
        per_step([int(r) for r in args.step_rows.split(",")], args.step_repeats, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
