"""A tensor-parallel worker process: rank r of N holds its shard of every model of the engine (or
`Runtime`) and its heads' KV cache, and runs each step that rank 0 sends it.

Messages arrive on a pipe from rank 0, each pickled: `("add_model", key, spec)`, `("step", key,
StepData)`, `("report",)`, `("shutdown",)`. The worker says `("connected",)` once it reaches rank 0's
rendezvous store (its imports, device and cores set up), and its entry point (engine/tp_start.py)
says `("failed", cause)` before an error ends the process. A step runs the very runner code rank 0
runs, so every collective (the all-reduces inside the layers, the gathers of vocabulary-parallel
logits) is met in the same order; what this rank samples is dropped. The worker ends when rank 0
says so, when the pipe closes (rank 0 died), or when a step fails (rank 0 sees the exit and names
this rank and the error).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from treeserve.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

# A collective that waits longer than this for another rank fails (the peer died or hung).
COLLECTIVE_TIMEOUT_S = 7.0


@dataclass
class ModelSpec:
    """What a worker needs to build its shard of one model."""
    model_dir: str
    dtype: torch.dtype
    max_positions: int
    load_format: str
    seed: int
    attention_backend: str
    block_size: int
    num_pages: int
    page_bytes: int
    arena_key: int = 0  # models of a Runtime's shared arena name the same one: the worker shares it too
    quantization: str | None = None  # the scheme rank 0 resolved (model/quantization/scheme.py)


START_TIMEOUT_S = 120.0  # every rank importing torch and joining the group


def rendezvous_store(host: str, world_size: int) -> tuple[dist.TCPStore, str]:
    """Rank 0's rendezvous store, listening before any other rank starts; returns it and the address
    the other ranks join by. Port 0: the kernel picks a free port as the store binds it (a port picked
    first and bound later can be taken in between by any outgoing connection: seen in CI as
    EADDRINUSE while Ray started its actors)."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=START_TIMEOUT_S),
                          wait_for_workers=False)
    return store, f"tcp://{f'[{host}]' if ':' in host else host}:{store.port}"


def connect_store(init_method: str, world_size: int) -> dist.TCPStore:
    """A client of rank 0's rendezvous store at `init_method`."""
    address = urlsplit(init_method)
    return dist.TCPStore(address.hostname, address.port, world_size, is_master=False,
                         timeout=timedelta(seconds=START_TIMEOUT_S))


def init_distributed(rank: int, world_size: int, init_method: str, device_type: str,
                     store: dist.Store | None = None, timeout_s: float = START_TIMEOUT_S):
    """Joins the default group through rank 0's store (`store` on rank 0; the others connect to
    `init_method`) within `timeout_s` (by default generous, as ranks start at different speeds);
    then the group the model's collectives use, which gives up on a silent peer after
    COLLECTIVE_TIMEOUT_S."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if store is None:
        store = connect_store(init_method, world_size)
    hook = sys.excepthook
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    if rank == 0:  # the user's own process: torch's "[rank0]: " before each line of its tracebacks,
        sys.excepthook = hook  # one more for each engine started, is noise there
    return dist.new_group(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def leave_group() -> None:
    """Leaves this process's default group, or forgets one that failed to form: torch names groups
    by a counter that a failed `init_process_group` leaves raised, and the next rank 0 would then
    wait on keys that its fresh workers (counting from 0) write under other names."""
    if dist.is_initialized():
        dist.destroy_process_group()  # resets the counter too
    else:
        dist.distributed_c10d._world.group_count = 0


class Worker:
    """One rank's state: its shard of each model and a runner over its KV pages. The process-pool
    loop below and the Ray actor (engine/tp_ray.py) both drive it."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: str, threads: int,
                 gpu_index: int | None = None):
        """`device`: rank 0's; on CUDA rank r takes the r-th GPU after rank 0's, unless `gpu_index`
        names its GPU (a Ray actor sees only its own, as cuda:0)."""
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.init_method = rank, world_size, init_method
        if device.startswith("cuda"):
            index = gpu_index if gpu_index is not None else (torch.device(device).index or 0) + rank
            device = f"cuda:{index}"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.group, self.runners, self.models, self.arenas = None, {}, {}, {}

    def join(self, connected: Callable[[], None] = lambda: None) -> None:
        """Joins the group; `connected` runs once rank 0's store answers, right before the rendezvous."""
        store = connect_store(self.init_method, self.world_size)
        connected()
        self.group = init_distributed(self.rank, self.world_size, self.init_method, self.device.type, store)

    def add_model(self, key: str, spec: ModelSpec) -> str:
        prepare_kernels(self.device)
        tp = TensorParallel(self.rank, self.world_size, self.group)
        self.runners[key] = build_runner(spec, tp, self.device, self.models, self.arenas)
        in_use = {id(runner.arena) for runner in self.runners.values()}
        for arena_key in [k for k, arena in self.arenas.items() if id(arena) not in in_use]:
            del self.arenas[arena_key]  # a dry run's scratch pages
        return key

    def execute(self, key: str, step) -> None:
        self.runners[key].execute(step)

    def report(self) -> dict[str, int]:
        return {key: resident_bytes(runner.model) for key, runner in self.runners.items()}

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(rank: int, world_size: int, init_method: str, device: str, threads: int, conn) -> None:
    """The worker process's loop (run by tp_start.worker_process): messages from rank 0's pipe until
    told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank}: %(message)s")
    _exit_with_parent()
    if device == "cpu":
        pin_to_cores(rank, threads)
    worker = Worker(rank, world_size, init_method, device, threads)
    worker.join(connected=lambda: conn.send(("connected",)))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if message[0] == "shutdown":
                return
            if message[0] == "add_model":
                conn.send(("ready", worker.add_model(message[1], message[2])))
            elif message[0] == "step":
                worker.execute(message[1], message[2])
            elif message[0] == "report":
                conn.send(("report", worker.report()))
    finally:
        worker.leave()


def prepare_kernels(device: torch.device) -> None:
    """Builds (or loads) treeserve's CPU kernels before any step: a rank that built them inside its
    first step (a cold kernel cache; the compiler takes seconds) would keep the others waiting in a
    collective past COLLECTIVE_TIMEOUT_S, and the engine would fail as if that rank had died."""
    if device.type == "cpu":
        from treeserve.model import cpu_kernels

        cpu_kernels.load()


def build_runner(spec: ModelSpec, tp: TensorParallel, device: torch.device, models: dict, arenas: dict):
    """A runner over fresh KV pages; the model shard is built once per directory and reused (a
    `Runtime` attaches KV twice: a dry run on scratch pages, then the real ones)."""
    from treeserve.engine.kv_arena import KVArena
    from treeserve.engine.model_runner import ModelRunner
    from treeserve.model.backends import make_backend
    from treeserve.model.hf_config import load_model_config
    from treeserve.model.loader import build_model
    from pathlib import Path

    key = (spec.model_dir, spec.dtype, spec.max_positions, spec.load_format, spec.seed, spec.quantization)
    if key not in models:
        config = load_model_config(Path(spec.model_dir))
        model = build_model(Path(spec.model_dir), config, spec.dtype, device, spec.max_positions, spec.load_format,
                            spec.seed, tp, spec.quantization)
        model.backend = make_backend(spec.attention_backend, model.kv_config, spec.dtype, device)
        models[key] = model
    model = models[key]
    if spec.arena_key not in arenas:
        arenas[spec.arena_key] = KVArena(spec.num_pages, spec.page_bytes, device)
    arena = arenas[spec.arena_key]
    return ModelRunner(model, spec.block_size, arena, spec.dtype, device)


def pin_to_cores(rank: int, threads: int) -> None:
    """A CPU worker's threads on cores of their own: rank r on cores [r * threads, (r + 1) * threads),
    where the machine has them (rank 0, the engine's process, serves HTTP too and is left free)."""
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[rank * threads:(rank + 1) * threads]
    if len(mine) == threads:
        os.sched_setaffinity(0, mine)
        logger.info("rank %d pinned to cores %s", rank, mine)


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's weights (each storage once; tables such as RoPE's are not weights)."""
    seen, total = set(), 0
    for tensor in model.parameters():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def _exit_with_parent() -> None:
    """Ends this process if rank 0's process goes away without a word (killed)."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
