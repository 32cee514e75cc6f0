"""A quantized checkpoint's modules installed in the model: its projections' float weights dropped
before they are allocated, each decoded module put in as a quantized layer (a fused projection once
its last part arrives; with tensor parallelism, this rank's slice), experts dequantized into their
stacked parameters."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from treeserve.errors import ParamError
from treeserve.model.checkpoint_files import checkpoint_tensor_names
from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.quantization import QuantizedTensors, checkpoint_format, quantized_layer
from treeserve.model.quantization.weights import concat_rows
from treeserve.model.sharding import row_parallel, shard_quantized
from treeserve.model.weight_copier import WeightCopier
from treeserve.model.weight_names import expert_piece, fused_parts, target_name


def quantized_tensors(model: nn.Module, model_dir: Path, method: str | None) -> QuantizedTensors | None:
    """The gatherer of a quantized checkpoint's tensors (None for other checkpoints); the float
    weights of the projections it fills are dropped before they are ever allocated."""
    fmt = checkpoint_format(model_dir, method) if method is not None else None
    if fmt is None:
        return None
    quantized = QuantizedTensors(fmt, checkpoint_tensor_names(model_dir))
    if not quantized.modules:
        raise ParamError("quantization", f"{model_dir}: the checkpoint is quantized with {method!r}, but none of its "
                         f"tensors is ({', '.join(fmt.markers)} not found)")
    for target in _quantized_targets(model, quantized):
        model.get_submodule(target).weight = None  # replaced by the quantized layer once loaded
    return quantized


def _quantized_targets(model: nn.Module, quantized: QuantizedTensors) -> list[str]:
    """Our modules (fused names) that quantized checkpoint modules fill, experts aside."""
    targets = set()
    for prefix in quantized.modules:
        if expert_piece(prefix + ".weight") is None:
            targets.add(target_name(prefix + ".weight")[0].removesuffix(".weight"))
    for target in targets:
        if target == "lm_head" and model.lm_head is None and model.head_name is None:
            raise ParamError("quantization", "lm_head is quantized in the checkpoint, but its config ties the LM head "
                             "to the embeddings (tie_word_embeddings: true): set it false for this checkpoint")
        try:
            module = model.get_submodule(target)
        except AttributeError:
            raise ValueError(f"quantized checkpoint: unexpected quantized module {target!r}") from None
        if not isinstance(module, nn.Linear):
            raise ParamError("quantization", f"{target} is quantized in the checkpoint, and treeserve loads "
                             "quantized weights into linear projections only")
    return sorted(targets)


def install_quantized(model: DecoderForCausalLM, prefix: str, weight, copier: WeightCopier, dtype: torch.dtype,
                      parts: dict[str, dict[int, object]]) -> None:
    """One decoded quantized module: a projection replaced by its quantized layer (`quantized_layer`;
    a fused one's part kept in `parts` until the last arrives), an expert dequantized into its
    stacked parameter."""
    if expert_piece(prefix + ".weight") is not None:
        copier.copy(prefix + ".weight", weight.dequantize(torch.float32))
        return
    target, slot = target_name(prefix + ".weight")
    weight = shard_quantized(target, slot, weight, model.plan)
    module = target.removesuffix(".weight")
    pieces = parts.setdefault(module, {})
    pieces[0 if slot is None else slot] = weight
    if slot is None or len(pieces) == fused_parts(module):
        _replace_linear(model, module, concat_rows([pieces[i] for i in sorted(pieces)]), dtype)
        del parts[module]


def _replace_linear(model: nn.Module, module: str, weight, dtype: torch.dtype) -> None:
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    if weight.shape != (old.out_features, old.in_features):
        raise ValueError(f"quantized weight for {module} has shape {weight.shape}, expected "
                         f"{(old.out_features, old.in_features)}")
    split_inputs = model.plan.tp if model.plan.tp.enabled and row_parallel(module + ".weight") else None
    setattr(parent, child, quantized_layer(weight, old.bias, dtype, split_inputs))
