"""Tensor-parallel workers as Ray actors (`distributed_executor_backend="ray"`): ranks 1..N-1 live
in a placement group of the Ray cluster this process joins (`RAY_ADDRESS`, or a local instance
started here), so one engine can span several machines. Rank 0 stays the engine's process.

Steps go to each actor as a method call (Ray runs one caller's calls to an actor in order) that
rank 0 does not wait for; a call that failed, or an actor that died, surfaces at the next step or
in the collective waiting on it, as `WorkerDiedError` naming the rank.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket

import torch
import torch.distributed as dist

from treeserve.engine.tp_executor import WorkerDiedError
from treeserve.engine.tp_worker import (START_TIMEOUT_S, ModelSpec, Worker, init_distributed, leave_group,
                                       rendezvous_store)
from treeserve.errors import ParamError
from treeserve.model.parallel import TensorParallel

logger = logging.getLogger(__name__)


class RayWorker(Worker):
    """One rank as a Ray actor: `Worker`'s methods, and its process id."""

    def pid(self) -> int:
        return os.getpid()


class RayTPExecutor:
    def __init__(self, world_size: int, device: torch.device, threads_per_rank: int | None = None):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ParamError("distributed_executor_backend", "'ray' needs the ray package "
                             "(pip install 'treeserve[ray]')") from exc
        if dist.is_available() and dist.is_initialized():
            raise ParamError("tensor_parallel_size", "this process already runs a tensor-parallel engine")
        self.ray, self.world_size, self.device = ray, world_size, device
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            _join_ray(ray, os.environ.get("RAY_ADDRESS"), max(world_size - 1, os.cpu_count() or 1))
        torch.set_num_threads(self.threads)
        self.closed, self.actors, self.group_placement = False, [], None
        atexit.register(self.shutdown)
        try:
            self._start(placement_group, PlacementGroupSchedulingStrategy)
        except BaseException:
            self.shutdown()  # actors, placement group, and the Ray instance it started
            raise
        logger.info("tensor parallel over Ray: %d ranks (%s)", world_size, dist.get_backend())

    def _start(self, placement_group, PlacementGroupSchedulingStrategy) -> None:
        ray, world_size, device = self.ray, self.world_size, self.device
        if device.type == "cuda":
            check_ray_gpus(ray.cluster_resources().get("GPU", 0), world_size, local=self.started_ray)
        host = ray.util.get_node_ip_address()
        store, init_method = rendezvous_store(host, world_size)
        resources = {"GPU": 1, "CPU": 1} if device.type == "cuda" else {"CPU": 1}
        self.group_placement = placement_group([resources] * (world_size - 1), strategy="PACK")
        ray.get(self.group_placement.ready(), timeout=START_TIMEOUT_S)
        actor = ray.remote(RayWorker)
        self.actors = [actor.options(num_cpus=1, num_gpus=resources.get("GPU", 0),
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self.group_placement, i))
                       .remote(rank, world_size, init_method, device.type, self.threads,
                               0 if device.type == "cuda" else None)  # Ray shows each GPU actor its own as cuda:0
                       for i, rank in enumerate(range(1, world_size))]
        joined = [a.join.remote() for a in self.actors]
        self._pending = [[] for _ in self.actors]
        self.group = init_distributed(0, world_size, init_method, device.type, store)
        ray.get(joined, timeout=START_TIMEOUT_S)

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(0, self.world_size, self.group)

    def add_model(self, key: str, spec: ModelSpec) -> None:
        self._get([a.add_model.remote(key, spec) for a in self.actors])

    def send_step(self, key: str, step) -> None:
        self.check()
        for pending, actor in zip(self._pending, self.actors):
            pending.append(actor.execute.remote(key, step))

    def check(self) -> None:
        """Raises for a step an actor failed (its call's result holds the error)."""
        for rank, pending in enumerate(self._pending, start=1):
            done, pending[:] = self.ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in done:
                try:
                    self.ray.get(ref)
                except Exception as exc:
                    raise WorkerDiedError(rank, f"failed ({type(exc).__name__}: {exc})") from exc

    def failure(self, exc: BaseException) -> BaseException:
        for rank, actor in enumerate(self.actors, start=1):
            try:
                self.ray.get(actor.pid.remote(), timeout=2)
            except Exception:
                return WorkerDiedError(rank, "died")
        return exc

    def report(self) -> list[dict[str, int]]:
        return self._get([a.report.remote() for a in self.actors])

    def pids(self) -> list[int]:
        return self._get([a.pid.remote() for a in self.actors])

    def _get(self, refs):
        try:
            return self.ray.get(refs, timeout=START_TIMEOUT_S)
        except Exception as exc:
            raise self.failure(exc) from exc

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for actor in self.actors:
            try:
                self.ray.get(actor.leave.remote(), timeout=5)
            except Exception:
                pass
            self.ray.kill(actor)
        if self.group_placement is not None:
            self.ray.util.remove_placement_group(self.group_placement)
        leave_group()  # or forgets a failed one, so that the next engine in this process can start
        if self.started_ray:
            self.ray.shutdown()


def check_ray_gpus(cluster_gpus: float, world_size: int, local: bool) -> None:
    """On CUDA ranks 1..N-1 each take one of the Ray cluster's GPUs (a placement group bundle), and a
    local instance started here counts rank 0's GPU among its own: too few is a clear error at once,
    as vLLM checks the cluster's GPUs up front, not a placement group that waits START_TIMEOUT_S."""
    needed = world_size if local else world_size - 1
    if cluster_gpus >= needed:
        return
    where = ("the local Ray instance, which counts rank 0's too" if local
             else f"the Ray cluster, one for each of ranks 1..{world_size - 1} (rank 0 runs here)")
    most = int(cluster_gpus) if local else int(cluster_gpus) + 1
    raise ParamError("tensor_parallel_size", f"{world_size} ranks over Ray need {needed} GPUs in {where}, and it "
                     f"has {cluster_gpus:g}; use at most {max(most, 1)}, or a Ray cluster with more GPUs (RAY_ADDRESS)")


def _join_ray(ray, address: str | None, local_cpus: int) -> None:
    """Joins the Ray cluster at `address` (RAY_ADDRESS), or starts a local instance where it is None.
    One that nothing answers at is a clear error at once: Ray itself retries its address for minutes."""
    if address is None:  # "local": a new instance even where `ray start` left one running here
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=local_cpus)
        return
    _check_answers(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except ConnectionError as exc:
        raise ParamError("distributed_executor_backend", f"could not join the Ray cluster at RAY_ADDRESS={address} "
                         f"({exc}); one started with token authentication (`ray start`'s default from Ray 2.59) "
                         "needs RAY_AUTH_MODE=token here too") from exc


def _check_answers(address: str) -> None:
    """Raises unless something accepts a connection at a 'host:port' (or 'ray://host:port') address;
    'auto' and 'local' are Ray's own words, left to Ray."""
    if address in ("auto", "local"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ParamError("distributed_executor_backend", f"RAY_ADDRESS={address!r} is not host:port")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise _no_cluster(address, str(exc)) from exc


def _no_cluster(address: str, why: str) -> ParamError:
    return ParamError("distributed_executor_backend", f"no Ray cluster answers at RAY_ADDRESS={address} ({why}); "
                      "start one there (`ray start --head --port PORT`), or unset RAY_ADDRESS to run a local one")
