"""The 4-bit kernel (`linear_kernels.int4_linear`, csrc/int4_linear.c) against PyTorch's own 4-bit CPU
kernel (`aten._weight_int4pack_mm_for_cpu`) and the bfloat16 layer it replaces (`PackedLinear`,
oneDNN), on a Llama-3.2-1B MLP's two shapes, group size 128, by rows. Each arm cycles through
`--layers` weights so that they come from memory, as in a model's step, not from the CPU's caches.

    python benchmarks/int4_linear.py [--rows 1,4,16,32,64] [--layers 8]
"""
from __future__ import annotations

import argparse
import time

import torch

from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.packed_linear import PackedLinear

SHAPES = ((8192, 2048), (2048, 8192))  # (out, in): gate/up and down of Llama-3.2-1B
GROUP_SIZE = 128


def per_call_ms(fn, layers: int, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats / layers * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,64")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    library = cpu_kernels.load()
    if library is None or library.ts_int4_supported() != 1:
        raise SystemExit("the 4-bit kernel is not built here (needs a C compiler and AVX512-BF16)")
    torch.manual_seed(0)
    for n, k in SHAPES:
        qs = [torch.randint(0, 16, (n, k)) for _ in range(args.layers)]
        ours = [linear_kernels.int4_pack(q) for q in qs]
        scales, zeros = torch.rand(n, k // GROUP_SIZE) * 0.01, torch.full((n, k // GROUP_SIZE), 8.0)
        aten = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1) for q in qs]
        scales_and_zeros = torch.randn(k // GROUP_SIZE, n, 2, dtype=torch.bfloat16)
        dense = [PackedLinear(torch.nn.Linear(k, n, bias=False).bfloat16()) for _ in range(args.layers)]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            t_ours = per_call_ms(lambda: [linear_kernels.int4_linear(library, x, w, scales, zeros, GROUP_SIZE)
                                          for w in ours], args.layers)
            t_aten = per_call_ms(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, GROUP_SIZE, scales_and_zeros)
                                          for w in aten], args.layers)
            t_dense = per_call_ms(lambda: [layer(x) for layer in dense], args.layers)
            print(f"{n}x{k} rows {rows:3d}: int4 (ours) {t_ours:.3f} ms, int4 (aten) {t_aten:.3f} ms, "
                  f"bfloat16 {t_dense:.3f} ms; bfloat16 / ours {t_dense / t_ours:.2f}, aten / ours {t_aten / t_ours:.2f}")


if __name__ == "__main__":
    main()
