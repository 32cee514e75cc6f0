"""Host-to-device copies that do not stall the host."""
from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device: on CUDA through pinned memory and without waiting (the copy is
    ordered before later work on the stream); elsewhere the tensor itself."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors packed into one float64 tensor (exact for token ids and float32 values) and
    copied to pinned host memory without blocking; `tolist()` waits for that copy alone."""

    def __init__(self, parts: list[torch.Tensor]):
        packed = torch.cat([p.double().flatten() for p in parts])
        self._event = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def tolist(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
