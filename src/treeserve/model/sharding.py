"""This rank's part of each checkpoint tensor under tensor parallelism (parallel.py says whose is
what): float tensors sliced as they are read (safetensors slices, never whole), quantized weights
once decoded, cut in their own terms (`IntWeight.rows` / `columns`, weights.py): their packed words
hold several values along one dimension and their scales one per group, so no slice of the stored
tensors is a slice of the weight.

The loader names each tensor by our parameter (`target`, e.g. layers.0.mlp.down_proj.weight) and,
for a part of a fused projection, its `slot` (q 0, k 1, v 2; gate 0, up 1).
"""
from __future__ import annotations

import torch

from treeserve.errors import ParamError
from treeserve.model.parallel import ShardPlan
from treeserve.model.quantization.weights import FloatWeight, IntWeight

CHECKPOINT_FUSED = ("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")  # Phi-3 ships them fused
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # each rank holds a share of their inputs


def row_parallel(target: str) -> bool:
    return target.endswith(ROW_PARALLEL)


def parallel_cut(target: str, slot: int | None, plan: ShardPlan) -> tuple[int, int, int] | None:
    """(dimension, start, end) of this rank's part of a projection: rows of the column-parallel ones
    (q/k/v by heads, gate/up by MLP rows, their biases alike), columns of the row-parallel ones
    (o_proj by heads, down_proj by MLP rows); None for the rest."""
    if slot is not None:
        start, end = plan.qkv_rows()[slot] if "qkv" in target else plan.mlp_rows()
        return 0, start, end
    if target.endswith(CHECKPOINT_FUSED):
        raise ValueError(f"{target}: a checkpoint with its projections already fused (Phi-3's qkv_proj and "
                         "gate_up_proj) cannot be sharded for tensor parallelism yet")
    if target.endswith("o_proj.weight"):
        start = plan.tp.rank * plan.local_heads * plan.head_dim
        return 1, start, start + plan.local_heads * plan.head_dim
    if target.endswith("down_proj.weight"):
        return 1, *plan.mlp_rows()
    return None


def shard_tensor(target: str, slot: int | None, part, plan: ShardPlan) -> torch.Tensor:
    """This rank's part of a float tensor from its safetensors slice `part`: `parallel_cut`'s for the
    projections; o_proj's and down_proj's bias on rank 0 alone (the ranks' outputs are summed); a
    vocabulary range of the embedding and lm_head (zero-padded to the shard size); the rest whole."""
    cut = parallel_cut(target, slot, plan)
    if cut is not None:
        dim, start, end = cut
        return part[start:end] if dim == 0 else part[:, start:end]
    if target.endswith(("o_proj.bias", "down_proj.bias")):
        full = part[:]
        return full if plan.tp.rank == 0 else torch.zeros_like(full)
    if target in ("embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(part, plan)
    return part[:]


def _vocab_rows(part, plan: ShardPlan) -> torch.Tensor:
    start, end = plan.vocab_rows()
    rows = part[start:end] if end > start else None
    width = part.get_shape()[1]
    out = torch.zeros(plan.vocab_shard, width, dtype=rows.dtype if rows is not None else torch.float32)
    if rows is not None:
        out[:end - start] = rows
    return out


def shard_quantized(target: str, slot: int | None, weight: IntWeight | FloatWeight,
                    plan: ShardPlan) -> IntWeight | FloatWeight:
    """This rank's part of a decoded quantized weight, cut where `shard_tensor` cuts a float one
    (a quantized lm_head, vocabulary-parallel, is refused; other modules stay whole)."""
    if not plan.tp.enabled:
        return weight
    if target == "lm_head.weight":
        raise ParamError("tensor_parallel_size", "a quantized lm_head cannot be sharded for tensor parallelism "
                         "yet; run this checkpoint with tensor_parallel_size=1")
    cut = parallel_cut(target, slot, plan)
    if cut is None:
        return weight
    dim, start, end = cut
    if dim == 0:
        return weight.rows(start, end)
    try:
        return weight.columns(start, end)
    except ValueError as exc:
        module = target.removesuffix(".weight")
        raise ParamError("tensor_parallel_size", f"{plan.tp.world_size} ranks split {module}'s {weight.shape[1]} input "
                         f"features into shards of {end - start}, and {exc} (each rank's share of a quantized "
                         "row-parallel projection must hold whole groups)") from exc
