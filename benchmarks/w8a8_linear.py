"""W8A8 products on this CPU: treeserve's VNNI kernel (csrc/w8a8_linear.c) against the same product
through PyTorch (rows quantized in Python, `torch._int_mm`, float32 scaling: the path it replaced)
and the bfloat16 layer (`F.linear` and oneDNN's packed layer) on the same shapes, weights cycled
through copies so that they come from memory; then the Llama-3.2-1B shape's 112 projections of
one decode step (16 layers of qkv, o, gate_up, down) by the kernel. Prints ms and the ratios.

    python benchmarks/w8a8_linear.py [--rows 1 16 256] [--copies 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.packed_linear import PackedLinear, can_pack
from treeserve.model.quantization.activations import quantize_rows_int8

LAYER_SHAPES = [(8192, 2048), (2048, 8192)]
STEP_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # one 1B layer's projections
LAYERS = 16


def _ms(fn, copies: int, repeats: int = 24) -> float:
    fn(0)
    fn(1)
    start = time.perf_counter()
    for i in range(repeats):
        fn(i % copies)
    return (time.perf_counter() - start) / repeats * 1e3


def _pytorch_path(x, weight, scales):
    quantized, row_scales = quantize_rows_int8(x)
    scaled = torch._int_mm(weight, quantized.t()).float().mul_(scales[:, None]).mul_(row_scales.t())
    return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype).copy_(scaled.t())


def one_layer(library, rows_list: list[int], copies: int) -> None:
    block = library.ts_w8a8_block_channels()
    for n, k in LAYER_SHAPES:
        weights = [torch.randint(-128, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        scales = torch.rand(n) * 0.01
        packs = [linear_kernels.w8a8_pack(w, block) for w in weights]
        floats = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(min(copies, 4))]
        packed = [PackedLinear.of_weight(w) for w in floats] if can_pack(torch.bfloat16, torch.device("cpu")) else None
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            ours = _ms(lambda i: linear_kernels.w8a8_linear(library, x, *packs[i], scales, n), copies)
            pytorch = _ms(lambda i: _pytorch_path(x, weights[i], scales), copies)
            dense = _ms(lambda i: torch.nn.functional.linear(x, floats[i % len(floats)]), copies)
            onednn = _ms(lambda i: packed[i % len(packed)](x), copies) if packed else float("nan")
            print(f"{n} x {k}, {rows} rows: W8A8 kernel {ours:.2f} ms, quantize + torch._int_mm {pytorch:.2f} "
                  f"({pytorch / ours:.2f}x), bfloat16 F.linear {dense:.2f} ({dense / ours:.2f}x), "
                  f"oneDNN packed bfloat16 {onednn:.2f} ({onednn / ours:.2f}x)")


def one_step(library, rows_list: list[int]) -> None:
    block = library.ts_w8a8_block_channels()
    layers = [[linear_kernels.w8a8_pack(torch.randint(-128, 128, s, dtype=torch.int8), block) for s in STEP_SHAPES]
              for _ in range(LAYERS)]
    scales = {s: torch.rand(s[0]) for s in STEP_SHAPES}
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in STEP_SHAPES}}

        def step():
            for layer in layers:
                for (n, k), (packed, comp) in zip(STEP_SHAPES, layer):
                    linear_kernels.w8a8_linear(library, inputs[k], packed, comp, scales[(n, k)], n)

        step()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        weights = LAYERS * sum(n * k for n, k in STEP_SHAPES)
        median = statistics.median(times)
        print(f"1B shape, one step's projections at {rows} rows: {median * 1e3:.1f} ms "
              f"({weights / median / 1e9:.1f} GB/s of weights, {rows * weights / median / 1e9:.0f} G products/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--copies", type=int, default=8)
    args = parser.parse_args()
    library = cpu_kernels.load()
    if library is None or library.ts_w8a8_supported() != 1:
        raise SystemExit("the W8A8 kernel is not built here (no AVX512-VNNI, or no C compiler)")
    with torch.no_grad():
        one_layer(library, args.rows, args.copies)
        one_step(library, [r for r in args.rows if r <= 16])


if __name__ == "__main__":
    main()
