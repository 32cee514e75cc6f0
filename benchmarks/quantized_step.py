"""One decode step's projections of the Llama-3.2-1B shape (16 layers: qkv 2048 -> 3072, o 2048 ->
2048, gate/up 2048 -> 16384, down 8192 -> 2048; 112 calls, weights from memory) at a few row counts,
bfloat16 rows: the stored bfloat16 layers (csrc/bf16_linear.c, the engine's where it runs, and oneDNN's
packed), int8 weight-only and GPTQ-style 4-bit in
groups of 128 through treeserve's kernels, each in its packed layout (16-bit rows, vpdpwssd: CPUs
with AVX512-BF16 and VNNI) and its row-major one. Medians of `--repeats`.

    python benchmarks/quantized_step.py [--rows 1 16 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from treeserve.model.packed_linear import Bf16Linear, PackedLinear, bf16_kernel, can_pack
from treeserve.model.quantization import Int8Linear
from treeserve.model.quantization.int4_csrc import CsrcInt4Linear, csrc_int4_runs
from treeserve.model.quantization.weights import IntWeight

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # (in, out)
LAYERS, GROUP = 16, 128


def stored(k: int, n: int, ours: bool) -> nn.Module:
    """The engine's bfloat16 layer: csrc/bf16_linear.c where it runs (`ours`), else oneDNN's packed one."""
    weight = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    if ours:
        return Bf16Linear.of_weight(weight)
    return PackedLinear.of_weight(weight) if can_pack(torch.bfloat16, torch.device("cpu")) else nn.Linear(k, n).bfloat16()


def int8(k: int, n: int, pack: bool) -> nn.Module:
    with torch.device("meta"):
        linear = nn.Linear(k, n, bias=False)
    linear.weight = nn.Parameter(torch.randn(n, k) * 0.02, requires_grad=False)
    return Int8Linear(linear, dtype=torch.bfloat16, pack=pack)


def int4(k: int, n: int, pack: bool) -> nn.Module:
    weight = IntWeight(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // GROUP) * 0.01,
                       torch.full((n, k // GROUP), 8.0), 4, GROUP)
    return CsrcInt4Linear(weight, None, torch.bfloat16, pack=pack)


def step_ms(layers: list[nn.Module], rows: int, repeats: int) -> float:
    inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for k, _ in SHAPES}}
    calls = [(layer, inputs[layer.in_features]) for layer in layers]

    def run():
        for layer, x in calls:
            layer(x)
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    probe = IntWeight(torch.zeros(64, 256, dtype=torch.uint8), torch.ones(64, 2), torch.zeros(64, 2), 4, GROUP)
    packed_runs = Int8Linear(nn.Linear(64, 8).bfloat16()).packed
    arms = {}
    if bf16_kernel() is not None:
        arms["bfloat16 (ours)"] = lambda k, n: stored(k, n, True)
    arms["bfloat16 (oneDNN)"] = lambda k, n: stored(k, n, False)
    if packed_runs:
        arms["int8 packed"] = lambda k, n: int8(k, n, True)
    arms["int8 row-major"] = lambda k, n: int8(k, n, False)
    if csrc_int4_runs(probe, torch.bfloat16):
        if packed_runs:
            arms["int4 packed"] = lambda k, n: int4(k, n, True)
        arms["int4 row-major"] = lambda k, n: int4(k, n, False)
    print(f"{torch.get_num_threads()} threads; the packed kernels run here: {packed_runs}")
    for name, make in arms.items():
        layers = [make(k, n) for _ in range(LAYERS) for k, n in SHAPES]
        figures = ", ".join(f"{rows} rows {step_ms(layers, rows, args.repeats):7.1f} ms" for rows in args.rows)
        print(f"{name:18s} {figures}", flush=True)
        del layers
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
