"""Rank 0's side of tensor parallelism: starts ranks 1..N-1 as processes (torch.multiprocessing,
spawn), joins them in one torch.distributed group (gloo on CPU, NCCL on CUDA), and sends each of
them every step of every model as plain data over a pipe (rank 0 runs its own shard in this
process, and alone samples).

Starting cannot hang on a worker that dies: rank 0 waits for each worker's word that it reached the
rendezvous store (its imports, device and cores set up) while watching the processes, and only then
joins the group with them (on a thread, watching them still) within `RENDEZVOUS_TIMEOUT_S`. A
worker that fails or dies on the way is named with its cause at once.

A worker that dies later is noticed when the next step is sent, or by the collective that waits on it
(which gives up after `COLLECTIVE_TIMEOUT_S`): the engine then fails with `WorkerDiedError`
naming the rank (and the worker's own error, where it sent one), and `shutdown()` leaves no process
behind, nor the rendezvous store, so another engine can start in this process.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait as wait_for
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from treeserve.engine.tp_worker import (COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S, ModelSpec, init_distributed,
                                       leave_group, rendezvous_store)
from treeserve.errors import ParamError
from treeserve.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

# Every worker is up and at the store when rank 0 joins the group: the rendezvous itself takes
# milliseconds, so one that takes this long has a rank that died or hung in it.
RENDEZVOUS_TIMEOUT_S = COLLECTIVE_TIMEOUT_S

class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone or stopped answering; the engine cannot go on."""

    def __init__(self, rank: int | None, detail: str):
        who = f"rank {rank}" if rank is not None else "(rank unknown)"
        super().__init__(f"tensor-parallel worker {who} {detail}")
        self.rank = rank


class TPExecutor:
    def __init__(self, world_size: int, device: torch.device, threads_per_rank: int | None, *,
                 entry: Callable[..., None]):
        """`entry`: the function each worker process runs (tp_start.worker_process), with its rank,
        the world size, the store's address, the device, its threads and its end of the pipe."""
        _Rendezvous.await_left_behind()
        if dist.is_available() and dist.is_initialized():
            raise ParamError("tensor_parallel_size", "this process already runs a tensor-parallel engine "
                             "(one per process: a Runtime puts all its models on the same workers)")
        _check_gpus(world_size, device)
        self.world_size, self.device = world_size, device
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(self.threads)
        self.procs, self.pipes, self.closed = [], [], False
        self._last_words: dict[int, tuple] = {}  # rank -> the ("failed", cause) it sent before exiting
        self._joining: _Rendezvous | None = None
        self.store, init_method = rendezvous_store("127.0.0.1", world_size)
        atexit.register(self.shutdown)
        try:
            self._spawn(entry, init_method)
            self._await_connected()
            self.group = self._rendezvous(init_method)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s, %d threads each)", world_size, dist.get_backend(), self.threads)

    def _spawn(self, entry: Callable[..., None], init_method: str) -> None:
        context = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=entry, name=f"treeserve-tp-rank-{rank}", daemon=True,
                                   args=(rank, self.world_size, init_method, str(self.device), self.threads, theirs))
            self.pipes.append(ours)
            proc.start()
            theirs.close()
            self.procs.append(proc)

    def _await_connected(self) -> None:
        """Returns once every worker says it reached the store; raises WorkerDiedError naming the
        first that fails or dies, or one silent past START_TIMEOUT_S (importing PyTorch on a busy
        machine is slow, but not that slow)."""
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerDiedError(min(waiting), f"did not start within {START_TIMEOUT_S:.0f} s")
            wait_for([h for rank in waiting for h in (self.pipes[rank - 1], self.procs[rank - 1].sentinel)], left)
            for rank in sorted(waiting):
                pipe, proc = self.pipes[rank - 1], self.procs[rank - 1]
                if pipe.poll():
                    message = _receive(pipe)
                    if message != ("connected",):
                        raise self._death(rank, "while starting", message)
                    waiting.discard(rank)
                elif not proc.is_alive():
                    raise self._death(rank, "while starting")

    def _rendezvous(self, init_method: str):
        """The group, joined with workers that are all at the store by now (see RENDEZVOUS_TIMEOUT_S),
        or WorkerDiedError as soon as one dies: gloo itself notices a peer that died after posting
        its address only after tens of seconds."""
        self.store.set_timeout(timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        self._joining = _Rendezvous(lambda: init_distributed(0, self.world_size, init_method, self.device.type,
                                                             self.store, RENDEZVOUS_TIMEOUT_S))
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S + 1
        while not self._joining.ended(wait_s=0.1) and time.monotonic() < deadline:
            self.check()
        error = self._joining.error
        if self._joining.ended() and error is None:
            self.store.set_timeout(timedelta(seconds=START_TIMEOUT_S))
            return self._joining.group
        raise self._died_error(wait_s=1.0) or WorkerDiedError(
            self._stopped_rank(), f"did not join the group within {RENDEZVOUS_TIMEOUT_S:.0f} s"
            + (f" ({error})" if error is not None else "")) from error

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(0, self.world_size, self.group)

    def add_model(self, key: str, spec: ModelSpec) -> None:
        """Every worker builds its shard of the model (and KV pages); returns once all are ready."""
        for pipe in self.pipes:
            pipe.send(("add_model", key, spec))
        for rank in range(1, self.world_size):
            self._answer(rank, f"loading {key!r}", START_TIMEOUT_S)

    def report(self) -> list[dict[str, int]]:
        """Each worker's resident weight bytes by model (rank 1 first)."""
        for pipe in self.pipes:
            pipe.send(("report",))
        return [self._answer(rank, "report", 30.0)[1] for rank in range(1, self.world_size)]

    def _answer(self, rank: int, what: str, timeout: float):
        """A worker's reply, or WorkerDiedError when it fails, dies or stays silent past `timeout`."""
        pipe, proc = self.pipes[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + timeout
        while not pipe.poll(0.2):
            if not proc.is_alive():
                raise self._death(rank, f"during {what}")
            if time.monotonic() > deadline:
                raise WorkerDiedError(rank, f"did not answer {what} within {timeout:.0f} s")
        message = _receive(pipe)
        if message is None or message[0] == "failed":
            raise self._death(rank, f"during {what}", message)
        return message

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
            return WorkerDiedError(self._stopped_rank(), f"stopped answering: a collective waited "
                                   f"{COLLECTIVE_TIMEOUT_S:.0f} s for it ({exc})")
        return exc

    def _stopped_rank(self) -> int | None:
        """The first worker that is stopped (SIGSTOP, a debugger), None where none is."""
        return next((rank for rank, proc in enumerate(self.procs, start=1)
                     if _process_state(proc.pid) in ("t", "T")), None)

    def _died_error(self, wait_s: float = 0.0) -> WorkerDiedError | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    return self._death(rank)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _death(self, rank: int, when: str = "", message: tuple | None = None) -> WorkerDiedError:
        """The error for a worker that failed or died (`when`: "while starting", ...): its own words
        where it sent any before exiting, else how it exited."""
        pipe, proc = self.pipes[rank - 1], self.procs[rank - 1]
        if message is None:
            message = self._last_words.get(rank) or (_receive(pipe) if not pipe.closed and pipe.poll() else None)
        when = f" {when}" if when else ""
        if message is not None and message[0] == "failed":
            self._last_words[rank] = message
            return WorkerDiedError(rank, f"failed{when}: {message[1]}")
        proc.join(timeout=1)  # it is exiting (its pipe closed): its exit code
        cause = _exit_cause(proc.exitcode)
        if proc.exitcode == 1 and when == " while starting":
            cause += (", before treeserve's worker code ran: see its traceback on stderr; often a script that "
                      "starts an engine outside `if __name__ == \"__main__\":`, which each worker imports again")
        return WorkerDiedError(rank, f"died{when} ({cause})")

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
        for pipe in self.pipes:
            pipe.close()
        if self._joining is None or self._joining.release():
            leave_group()
        self.store = None  # the last reference (a rendezvous left behind holds it until it ends)
        atexit.unregister(self.shutdown)


class _Rendezvous:
    """Rank 0's side of joining the group, on a thread of its own so that rank 0 can stop waiting
    the moment a worker dies. One that rank 0 leaves behind ends by itself (gloo gives up on the dead
    peer) and then leaves the group it made or forgets the one it failed to; the next executor in
    this process waits for that first."""
    left_behind: list[threading.Thread] = []

    def __init__(self, join: Callable[[], object]):
        self.group, self.error = None, None
        self._lock, self._ended, self._released = threading.Lock(), False, False
        self._thread = threading.Thread(target=self._run, args=(join,), name="treeserve-tp-rendezvous", daemon=True)
        self._thread.start()

    def _run(self, join: Callable[[], object]) -> None:
        try:
            self.group = join()
        except BaseException as exc:
            self.error = exc
        with self._lock:
            self._ended, released = True, self._released
        if released:
            leave_group()

    def ended(self, wait_s: float = 0.0) -> bool:
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def release(self) -> bool:
        """True where it has ended (the caller leaves the group); False where it will leave by itself."""
        with self._lock:
            self._released = True
            if not self._ended:
                _Rendezvous.left_behind.append(self._thread)
            return self._ended

    @classmethod
    def await_left_behind(cls) -> None:
        while cls.left_behind:
            thread = cls.left_behind[0]
            thread.join(START_TIMEOUT_S)
            if thread.is_alive():
                raise RuntimeError("tensor parallelism: a failed start's rendezvous is still running")
            cls.left_behind.pop(0)


def _check_gpus(world_size: int, device: torch.device) -> None:
    """On CUDA rank r takes the r-th GPU after rank 0's: a clear error, before any process starts,
    where there are fewer (vLLM's check too), instead of each missing one failing in its worker."""
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + world_size > count:
        raise ParamError("tensor_parallel_size", f"{world_size} ranks need {world_size} GPUs from cuda:{first} on, "
                         f"and this machine has {count} (cuda:0..cuda:{count - 1}); use at most "
                         f"{max(count - first, 1)}, or several machines (distributed_executor_backend='ray')")


def _receive(pipe) -> tuple | None:
    """The next message on `pipe`, None where the worker's end is closed (it exited)."""
    try:
        return pipe.recv()
    except (EOFError, OSError):
        return None


def _exit_cause(exitcode: int | None) -> str:
    """'exit code 1', 'exit code -9: killed by SIGKILL', ..."""
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"exit code {exitcode}: killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"exit code {exitcode}: killed by signal {-exitcode}"


def _process_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped), '' where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
