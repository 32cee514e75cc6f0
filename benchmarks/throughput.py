"""Offline throughput: treeserve vs HF transformers' `generate`, same run (see treeserve.bench.offline).

    python benchmarks/throughput.py [--num-prompts 64] [--dtype auto|float32|bfloat16]
    treeserve bench throughput ...   (the same)
"""
import sys

from treeserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
