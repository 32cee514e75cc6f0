"""Rank 0's side of tensor parallelism: starts ranks 1..N-1 as processes (torch.multiprocessing,
spawn), joins them in one torch.distributed group (gloo on CPU, NCCL on CUDA), and sends each of
them every step of every model as plain data over a pipe (rank 0 runs its own shard in this
process, and alone samples).

A worker that dies is noticed when the next step is sent, or by the collective that waits on it
(which gives up after `COLLECTIVE_TIMEOUT_S`): the engine then fails with `WorkerDiedError`
naming the rank, and `shutdown()` leaves no process behind.
"""
from __future__ import annotations

import atexit
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from treeserve.engine.tp_worker import (COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S, ModelSpec, init_distributed,
                                       rendezvous_store, worker_main)
from treeserve.errors import ParamError
from treeserve.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone or stopped answering; the engine cannot go on."""

    def __init__(self, rank: int | None, detail: str):
        who = f"rank {rank}" if rank is not None else "(rank unknown)"
        super().__init__(f"tensor-parallel worker {who} {detail}")
        self.rank = rank


class TPExecutor:
    def __init__(self, world_size: int, device: torch.device, threads_per_rank: int | None = None):
        if dist.is_available() and dist.is_initialized():
            raise ParamError("tensor_parallel_size", "this process already runs a tensor-parallel engine "
                             "(one per process: a Runtime puts all its models on the same workers)")
        self.world_size, self.device = world_size, device
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(self.threads)
        store, init_method = rendezvous_store("127.0.0.1", world_size)
        context = mp.get_context("spawn")
        self.procs, self.pipes = [], []
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=worker_main, name=f"treeserve-tp-rank-{rank}", daemon=True,
                                   args=(rank, world_size, init_method, str(device), self.threads, theirs))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.pipes.append(ours)
        self.closed = False
        atexit.register(self.shutdown)
        try:
            self.group = init_distributed(0, world_size, init_method, device.type, store)
        except Exception as exc:
            self.shutdown()
            raise self._died_error() or RuntimeError(f"tensor-parallel workers did not start: {exc}") from exc
        logger.info("tensor parallel: %d ranks (%s, %d threads each)", world_size, dist.get_backend(), self.threads)

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(0, self.world_size, self.group)

    def add_model(self, key: str, spec: ModelSpec) -> None:
        """Every worker builds its shard of the model (and KV pages); returns once all are ready."""
        for pipe in self.pipes:
            pipe.send(("add_model", key, spec))
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs), start=1):
            self._answer(rank, pipe, proc, f"loading {key!r}", START_TIMEOUT_S)

    def report(self) -> list[dict[str, int]]:
        """Each worker's resident weight bytes by model (rank 1 first)."""
        for pipe in self.pipes:
            pipe.send(("report",))
        return [self._answer(rank, pipe, proc, "report", 30.0)[1]
                for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs), start=1)]

    @staticmethod
    def _answer(rank: int, pipe, proc, what: str, timeout: float):
        """A worker's reply, or WorkerDiedError when it dies or stays silent past `timeout`."""
        deadline = time.monotonic() + timeout
        while not pipe.poll(0.2):
            if not proc.is_alive():
                raise WorkerDiedError(rank, f"died during {what} (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise WorkerDiedError(rank, f"did not answer {what} within {timeout:.0f} s")
        return pipe.recv()

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def send_step(self, key: str, step) -> None:
        self.check()
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(("step", key, step))
            except (BrokenPipeError, OSError) as exc:
                raise self._died_error() or WorkerDiedError(rank, "stopped taking steps") from exc

    def check(self) -> None:
        error = self._died_error()
        if error is not None:
            raise error

    def failure(self, exc: BaseException) -> BaseException:
        """What to raise for an error during a step: a worker's death where one died (a collective
        fails while waiting on it), else a hung worker for a collective timeout, else `exc`."""
        died = self._died_error(wait_s=0.5)
        if died is not None:
            return died
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            stopped = [rank for rank, proc in enumerate(self.procs, start=1) if _process_state(proc.pid) in ("t", "T")]
            return WorkerDiedError(stopped[0] if stopped else None, f"stopped answering: a collective waited "
                                   f"{COLLECTIVE_TIMEOUT_S:.0f} s for it ({exc})")
        return exc

    def _died_error(self, wait_s: float = 0.0) -> WorkerDiedError | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    return WorkerDiedError(rank, f"died (exit code {proc.exitcode})")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def shutdown(self) -> None:
        """Stops every worker (asked first, then terminated, then killed) and leaves the group."""
        if self.closed:
            return
        self.closed = True
        for pipe in self.pipes:
            try:
                pipe.send(("shutdown",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _process_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped), '' where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
