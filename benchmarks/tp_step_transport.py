"""How rank 0 should hand each step to the other ranks: a pipe per worker (what treeserve does) or a
torch.distributed broadcast of the pickled step (gloo), timed on two steps of the size a server sends.

A decode step of 64 requests already known to the worker (one new token each) and a prefill step of
8 new requests of 512 prompt tokens each; the time is rank 0's send plus the worker's receive and
unpickle, measured as a round trip (the worker answers with one byte) and halved.

    python benchmarks/tp_step_transport.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from treeserve.engine.step_data import CachedRequestData, NewRequestData, StepData
from treeserve.ports import free_port
from treeserve.sampling_params import SamplingParams


def steps() -> dict[str, StepData]:
    decode = StepData(scheduled=[(f"r{i}", 1) for i in range(64)],
                      cached_requests=[CachedRequestData(f"r{i}", [17], 40, [], 640 + i) for i in range(64)])
    prefill = StepData(scheduled=[(f"p{i}", 512) for i in range(8)],
                       new_requests=[NewRequestData(f"p{i}", list(range(512)), 512, list(range(32 * i, 32 * i + 32)),
                                                    0, SamplingParams(temperature=0.7, max_tokens=64))
                                     for i in range(8)])
    return {"decode, 64 known requests": decode, "prefill, 8 new requests x 512 tokens": prefill}


def worker(init_method: str, conn, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2, timeout=timedelta(seconds=60))
    for _ in steps():
        for _ in range(repeats):  # the pipe
            conn.recv()
            conn.send_bytes(b"k")
        for _ in range(repeats):  # the broadcast
            box = [None]
            dist.broadcast_object_list(box, src=0)
            conn.send_bytes(b"k")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(target=worker, args=(init_method, theirs, args.repeats))
    proc.start()
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2, timeout=timedelta(seconds=60))
    print(f"{os.cpu_count()} cores; one-way time per step (median of {args.repeats} round trips, halved)")
    for label, step in steps().items():
        pipe, broadcast = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            ours.send(step)
            ours.recv_bytes()
            pipe.append((time.perf_counter() - start) / 2)
        for _ in range(args.repeats):
            start = time.perf_counter()
            dist.broadcast_object_list([step], src=0)
            ours.recv_bytes()
            broadcast.append((time.perf_counter() - start) / 2)
        p, b = statistics.median(pipe) * 1e6, statistics.median(broadcast) * 1e6
        print(f"{label}: pipe {p:.0f} us, gloo broadcast {b:.0f} us (broadcast / pipe {b / p:.2f}x)")
    proc.join()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
