"""A model's weights freed now, not when the last reference to the model goes: a closed engine may
stay referenced (a notebook's variable, a FastAPI route cache holding an app's endpoints) and must
not keep its weights alive there."""
from __future__ import annotations

import torch
from torch import nn

from treeserve.model.heap import release_freed_heap


def release_weights(model: nn.Module) -> int:
    """Frees the storage of every parameter, buffer and tensor attribute of `model`'s modules (shared
    ones, tied heads included, once) and leaves empty tensors in their place; returns the bytes freed.
    Storage another object still views is freed too (its views read nothing after): only for a model
    no one else runs."""
    freed, seen = 0, set()
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    freed += _free(tensor, seen)
                    table[name] = _empty_like(tensor)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                freed += _free(value, seen)
                setattr(module, name, _empty_like(value))
    release_freed_heap()
    return freed


def _free(tensor: torch.Tensor, seen: set[int]) -> int:
    """Resizes the tensor's storage to nothing where it can be (a mapped checkpoint's cannot: dropping
    the last reference unmaps it); the bytes it held, counted once per storage."""
    if tensor.is_meta:
        return 0
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key in seen or storage.nbytes() == 0:
        return 0
    seen.add(key)
    nbytes = storage.nbytes()
    if storage.resizable():
        storage.resize_(0)
    return nbytes


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return nn.Parameter(empty, requires_grad=False) if isinstance(tensor, nn.Parameter) else empty
