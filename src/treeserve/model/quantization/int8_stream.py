"""`--quantization int8` while the checkpoint loads: each decoder projection, and the LM head (a tied
one's embedding with it, int8_head.py), is quantized as soon as its tensors (a fused projection's
parts) are read, so its float weight is never allocated beside the others'. Quantizing after the whole float model was loaded held every projection in the model's
dtype at once: a load peaked at the bfloat16 model's size (2.8 GiB for a 1B model that holds 1.7
quantized); now at the quantized model's plus one projection.

The numbers are those of quantizing the loaded model: the checkpoint's tensor is rounded to the
model's dtype first, as copying it into the parameter did, then `quantize_channels` (with a
row-parallel rank's whole-row maxima, `channel_amax`). Biases load into the float linears' own
parameters, which the int8 layers share.
"""
from __future__ import annotations

import torch
from torch import nn

from treeserve.model.quantization.int8 import QUANTIZED_PROJECTIONS, Int8Linear, quantize_channels
from treeserve.model.quantization.int8_head import install_head


class StreamedInt8:
    def __init__(self, model: nn.Module, dtype: torch.dtype, channel_amax: dict[str, torch.Tensor] | None = None):
        """Before the model is materialized: the projections `quantize_linears` would replace lose their
        float weights (never allocated), and are filled here from the checkpoint."""
        self.model, self.dtype, self.channel_amax = model, dtype, channel_amax or {}
        self.linears = {f"{name}.weight": module for name, module in model.named_modules()
                        if name.startswith("layers.") and name.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS
                        and type(module) is nn.Linear}
        self.head = _head_target(model)
        if self.head is not None:
            self.linears[self.head] = model.get_submodule(self.head.removesuffix(".weight"))
        for linear in self.linears.values():
            linear.weight = None
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def owns(self, target: str) -> bool:
        """Whether `target` (our parameter's name, layers.0.self_attn.qkv_proj.weight) is streamed here."""
        return target in self.linears

    def add(self, target: str, slot: int | None, parts_needed: int, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of `target` (a fused projection's part `slot` of `parts_needed`): the
        projection replaced by its int8 layer once all its parts are here."""
        parts = self._parts.setdefault(target, {})
        parts[0 if slot is None else slot] = tensor.to(self.dtype)
        if slot is not None and len(parts) < parts_needed:
            return
        del self._parts[target]
        weight = parts[0] if len(parts) == 1 else torch.cat([parts[i] for i in sorted(parts)])
        module = self.linears.pop(target)
        shape = (module.num_embeddings, module.embedding_dim) if isinstance(module, nn.Embedding) \
            else (module.out_features, module.in_features)
        if tuple(weight.shape) != shape:
            raise ValueError(f"tensor for {target} has shape {tuple(weight.shape)}, expected {shape}")
        name = target.removesuffix(".weight")
        quantized, scales = quantize_channels(weight, self.channel_amax.get(name))
        del weight, parts
        layer = Int8Linear(quantized=quantized, scales=scales, bias=getattr(module, "bias", None), dtype=self.dtype,
                           consume=True)
        if target == self.head:
            install_head(self.model, layer, self.dtype)
            return
        parent_name, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, layer)

    def missing(self) -> list[str]:
        """The projections whose tensors did not all arrive."""
        return sorted(self.linears)


def _head_target(model: nn.Module) -> str | None:
    """The LM head's matrix as the checkpoint names it in our terms, where it is streamed too: an
    `lm_head` of its own, or the embedding a tied head reads (one rank's whole vocabulary: a
    vocabulary-parallel embedding keeps its rows, its head is quantized after loading); none for a
    reward model's head."""
    if getattr(model, "head_name", None) is not None:
        return None
    if type(model.lm_head) is nn.Linear:
        return "lm_head.weight"
    if model.lm_head is None and type(model.embed_tokens) is nn.Embedding:
        return "embed_tokens.weight"
    return None
