"""A checkpoint's tensors read by our parameter names: this rank's shard of each, the file that holds
one parameter's tensor, and the row-parallel projections' per-channel maxima over their whole rows."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch

from treeserve.model.checkpoint_files import iter_checkpoint_tensors, read_tensors, safetensors_files, tensor_names
from treeserve.model.parallel import ShardPlan
from treeserve.model.sharding import row_parallel, shard_tensor
from treeserve.model.weight_names import target_name


def iter_checkpoint_shards(model_dir: Path, plan: ShardPlan,
                           whole: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor's part that this rank holds (the whole tensor without parallelism), or
    the whole tensor where `whole(name)` (quantized modules' packed tensors: sliced once decoded)."""
    if not plan.tp.enabled:
        yield from iter_checkpoint_tensors(model_dir)
        return

    def read(handle, name: str) -> torch.Tensor:
        if whole(name):
            return handle.get_tensor(name)
        return shard_tensor(*target_name(name), handle.get_slice(name), plan)

    for path in safetensors_files(model_dir):
        yield from read_tensors(path, read)


def checkpoint_tensor(model_dir: Path, target: str) -> tuple[Path, str] | None:
    """(the file, the checkpoint's name) of the tensor that fills our parameter `target`; None where
    no file holds one."""
    for path in safetensors_files(model_dir):
        for name in tensor_names(path):
            if target_name(name) == (target, None):
                return path, name
    return None


def row_parallel_amax(model_dir: Path, plan: ShardPlan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each row-parallel projection's (o_proj, down_proj) largest absolute weight per output channel
    over the whole row, as `dtype` holds the weights (module name -> float32 [out]): on-the-fly int8
    scales them as one rank would, although each rank holds a share of the row. Read one tensor at
    a time."""
    def wanted(name: str) -> bool:
        target = target_name(name)[0]
        return row_parallel(target) and ".experts." not in target

    return {target_name(name)[0].removesuffix(".weight"): tensor.to(dtype).float().abs().amax(dim=1)
            for name, tensor in iter_checkpoint_tensors(model_dir, wanted)}
