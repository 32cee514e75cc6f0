"""Storage for a model built on the "meta" device: uninitialised tensors on the real one, and the
random weights of `load_format="dummy"`."""
from __future__ import annotations

import torch
from torch import nn

from treeserve.model.decoder import DecoderForCausalLM


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialised storage for every tensor built on "meta" (floating ones in `dtype`): what
    `to_empty(device).to(dtype)` does, without its per-tensor Python references (their first call
    imports torch's symbolic shapes and sympy, ~1 s of a start) nor a second copy for the dtype."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = empty(buffer)


@torch.no_grad()
def init_dummy_weights(model: DecoderForCausalLM, seed: int, std: float = 0.02) -> None:
    """Norm weights 1 (Gemma's, which scale by 1 + w: 0), biases 0, every other weight normal(0, std)
    (transformers' initialiser)."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(0.0 if model.config.gemma_norms else 1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
