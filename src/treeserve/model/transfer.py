"""Host-to-device copies that do not stall the host."""
from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device: on CUDA through pinned memory and without waiting (the copy is
    ordered before later work on the stream); elsewhere the tensor itself."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
