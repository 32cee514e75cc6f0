"""Starting the tensor-parallel workers an engine (or a Runtime's engines) runs with, and the first
code a spawned worker runs.

This module imports neither PyTorch nor the worker at the top: a worker process imports it to run
`worker_process`, which imports the rest itself, so that an import that fails in the new process
(a broken environment: `TORCH_LOGS` with a typo, a shadowed package) reaches rank 0 with its cause
instead of a bare exit code.
"""
from __future__ import annotations


def start_executor(config, device):
    """The workers for `config.tensor_parallel_size` ranks, by `config.distributed_executor_backend`."""
    if config.distributed_executor_backend == "ray":
        from treeserve.engine.tp_ray import RayTPExecutor  # imports ray

        return RayTPExecutor(config.tensor_parallel_size, device, config.threads_per_rank)
    from treeserve.engine.tp_executor import TPExecutor

    return TPExecutor(config.tensor_parallel_size, device, config.threads_per_rank, entry=worker_process)


def worker_process(rank: int, world_size: int, init_method: str, device: str, threads: int, conn) -> None:
    """A spawned worker's entry point: the worker's imports, then its loop (`tp_worker.worker_main`).
    Whatever ends it with an error (an import, its device, joining the group, loading a model, a
    step) is told to rank 0 over `conn` before the process exits, so rank 0 can name the cause."""
    try:
        from treeserve.engine.tp_worker import worker_main

        worker_main(rank, world_size, init_method, device, threads, conn)
    except BaseException as exc:
        tell_failure(conn, exc)
        raise


def tell_failure(conn, exc: BaseException) -> None:
    """Sends rank 0 `("failed", "<type>: <message>")`, the message on one line; quiet if rank 0 is gone."""
    message = " ".join(str(exc).split())
    cause = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    try:
        conn.send(("failed", cause if len(cause) <= 240 else cause[:239] + "…"))
    except (BrokenPipeError, OSError):
        pass
