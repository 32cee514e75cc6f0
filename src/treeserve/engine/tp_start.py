"""Starting the tensor-parallel workers an engine (or a Runtime's engines) runs with."""
from __future__ import annotations

import torch

from treeserve.engine.tp_executor import TPExecutor


def start_executor(config, device: torch.device):
    """The workers for `config.tensor_parallel_size` ranks, by `config.distributed_executor_backend`."""
    if config.distributed_executor_backend == "ray":
        from treeserve.engine.tp_ray import RayTPExecutor  # imports ray

        return RayTPExecutor(config.tensor_parallel_size, device, config.threads_per_rank)
    return TPExecutor(config.tensor_parallel_size, device, config.threads_per_rank)
