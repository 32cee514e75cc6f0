"""Float checkpoint tensors copied into the model's parameters, checked for shape and for quantized
values that lack their scales; knows which parameters are still missing once the checkpoint is read."""
from __future__ import annotations

from pathlib import Path

import torch

from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.weight_names import IGNORED, checkpoint_names, expert_piece, fused_parts, target_name


class WeightCopier:
    """Copies checkpoint tensors into the model's parameters: fused projections once all their parts
    arrived, experts into their stacked parameters; knows what is still missing."""

    def __init__(self, model: DecoderForCausalLM, model_dir: Path, mapped: frozenset[str] = frozenset()):
        self.model, self.model_dir = model, model_dir
        self.params = dict(model.named_parameters())
        self.pending: dict[str, dict[int, torch.Tensor]] = {}
        self.pieces: dict[str, set] = {}  # stacked expert parameters: the (expert, part) pieces copied so far
        self.mapped = mapped  # parameters over the checkpoint file's own pages (model/mapped_embedding.py)
        self.loaded: set[str] = set(mapped)

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        if IGNORED.search(name) or (name == "lm_head.weight" and self.model.lm_head is None):
            return
        if (piece := expert_piece(name)) is not None and piece[0] in self.params:
            target, expert, part = piece
            needed = _copy_expert(self.params[target], expert, part, tensor, name)
            self.pieces.setdefault(target, set()).add((expert, part))
            if len(self.pieces[target]) == needed:
                self.loaded.add(target)
            return
        target, slot = target_name(name)
        if target in self.mapped:
            return
        if target not in self.params:
            raise ValueError(f"{self.model_dir}: unexpected tensor {name!r} in checkpoint")
        if slot is None:
            _copy_into(self.params[target], tensor, name)
            self.loaded.add(target)
            return
        parts = self.pending.setdefault(target, {})
        parts[slot] = tensor
        if len(parts) == fused_parts(target):
            _copy_into(self.params[target], torch.cat([parts[i] for i in sorted(parts)]), name)
            self.loaded.add(target)
            del self.pending[target]

    def check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            names = [n for param in missing for n in checkpoint_names(param, self.pending.get(param, {}))]
            raise ValueError(f"{self.model_dir}: the checkpoint lacks the tensors "
                             f"{names[:5]}{'...' if len(names) > 5 else ''}")


def _copy_expert(param: torch.Tensor, expert: int, part: int | None, tensor: torch.Tensor, name: str) -> int:
    """Copies one expert's projection into its slice of the stacked parameter; returns how many
    such pieces fill the parameter."""
    if expert >= param.shape[0]:
        raise ValueError(f"tensor {name!r} names expert {expert}; the model has {param.shape[0]}")
    if part is None:
        _copy_into(param[expert], tensor, name)
        return param.shape[0]
    half = param.shape[1] // 2
    _copy_into(param[expert, part * half:(part + 1) * half], tensor, name)
    return 2 * param.shape[0]


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    if param.is_floating_point() and (not tensor.is_floating_point() or tensor.element_size() == 1):
        # (int8, FP8: quantized values, which without their scales would load as garbage)
        raise ValueError(f"tensor {name!r} is {tensor.dtype}, quantized values without the scales that read them "
                         f"(is its module's weight_scale missing from the checkpoint?): it cannot load as a plain "
                         f"{param.dtype} weight")
    with torch.no_grad():
        param.copy_(tensor)
