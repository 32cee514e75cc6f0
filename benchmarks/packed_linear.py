"""`F.linear` against the oneDNN-packed linear (treeserve.model.packed_linear), bfloat16 on CPU.

For the benchmark model's layer shapes and a range of rows (a decode step's rows are its batch),
prints microseconds per call of both, their ratio, and whether the results are bit-identical.

    python benchmarks/packed_linear.py [--rows 1,8,24,64,256,1024] [--repeats 50]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from treeserve.model.packed_linear import PackedLinear, can_pack

# (in, out) of the ~150M benchmark model's layers: qkv, o, gate+up, down, lm_head
SHAPES = [(768, 1280), (768, 768), (768, 4608), (2304, 768), (768, 32000)]


def per_call_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,24,64,256,1024")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        print("this CPU has no fast bfloat16 (AVX512-BF16 or AMX), or torch has no oneDNN: nothing is packed here")
        return 0
    print(f"{'in x out':>12}{'rows':>6}{'F.linear us':>13}{'packed us':>11}{'speed-up':>10}  identical")
    for k, n in SHAPES:
        linear = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        packed = PackedLinear(linear)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            with torch.inference_mode():
                plain_us = per_call_us(lambda: linear(x), args.repeats)
                packed_us = per_call_us(lambda: packed(x), args.repeats)
                same = torch.equal(linear(x), packed(x))
            print(f"{f'{k}x{n}':>12}{rows:>6}{plain_us:>13.1f}{packed_us:>11.1f}{plain_us / packed_us:>10.2f}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
