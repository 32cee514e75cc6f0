"""Host-to-device copies that do not stall the host."""
from __future__ import annotations

import math

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device: on CUDA through pinned memory and without waiting (the copy is
    ordered before later work on the stream); elsewhere the tensor itself."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def values_to_device(values, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...] | None = None):
    """Values (a list, a numpy array or a host tensor) as a `dtype` tensor (of `shape`) on the device,
    through `to_device`."""
    tensor = torch.as_tensor(values, dtype=dtype)
    return to_device(tensor if shape is None else tensor.reshape(shape), device)


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
            self._event.record(torch.cuda.current_stream(packed.device))  # (the copy's device, not the current one)
        else:
            self._host = packed

    def tolist(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


ALIGN_BYTES = 16


class StepStaging:
    """A step's small host values (token ids, positions, slots, attention metadata) onto the device
    through one persistent host buffer per dtype and one copy each per step, instead of a tensor,
    a `pin_memory()` and a copy per value. `stage` writes values (a list, a numpy array or a host
    tensor) into the host buffer through numpy and returns their place in the device buffer (valid
    once `flush` has queued the copy, before any work that reads them). On CUDA the host buffers are
    pinned and there are two, used in turn, each written only after its last copy is done (the copy
    runs while the host builds the next step). Elsewhere `stage` returns a tensor of the values
    itself, unless `always` (tests, benchmarks: the same offsets and copies on CPU)."""

    INITIAL_ELEMENTS = 1 << 14

    def __init__(self, device: torch.device, always: bool = False):
        self.device = device
        self.active = device.type == "cuda" or always
        self._buffers: dict[torch.dtype, _StagingBuffer] = {}
        self.num_copies = 0  # host-to-device copies queued, all steps

    def stage(self, values, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """`values` as a `dtype` tensor on the device (of `shape`, else flat)."""
        if not self.active:
            return values_to_device(values, dtype, self.device, shape)
        buffer = self._buffers.get(dtype)
        if buffer is None:
            buffer = self._buffers[dtype] = _StagingBuffer(dtype, self.device, self.INITIAL_ELEMENTS)
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        return buffer.stage(values, shape, self)

    def flush(self) -> None:
        """Queues each buffer's copy of what was staged since the last flush."""
        for buffer in self._buffers.values():
            buffer.flush(self)


class _StagingBuffer:
    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int):
        self.dtype, self.device = dtype, device
        # each value starts on a 16-byte boundary: Triton specializes a kernel on its pointers' alignment
        self.align = max(1, ALIGN_BYTES // dtype.itemsize)
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        pinned = self.device.type == "cuda"
        self.hosts = [torch.empty(capacity, dtype=self.dtype, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self.host_arrays = [host.numpy() for host in self.hosts]  # (numpy writes a list or an array fastest)
        self.events: list = [None] * len(self.hosts)
        self.target = torch.empty(capacity, dtype=self.dtype, device=self.device)
        self.which, self.used, self.ready = 0, 0, False

    def stage(self, values, shape, owner: StepStaging) -> torch.Tensor:
        count = len(values) if shape is None else math.prod(shape)
        start = -(-self.used // self.align) * self.align
        if start + count > self.target.numel():
            self.flush(owner)  # what is staged keeps its place in the old device buffer
            self._allocate(max(2 * self.target.numel(), count))
            start = 0
        host = self._host()
        self.used = start + count
        if shape is None:
            host[start:self.used] = values
        else:
            host[start:self.used].reshape(shape)[...] = values
        view = self.target[start:self.used]
        return view if shape is None else view.view(shape)

    def _host(self):
        """The host buffer being filled (numpy); on the first write of a step, once its last copy is done."""
        if not self.ready:
            event = self.events[self.which]
            if event is not None:
                event.synchronize()
            self.ready = True
        return self.host_arrays[self.which]

    def flush(self, owner: StepStaging) -> None:
        if self.used == 0:
            return
        host = self.hosts[self.which]
        self.target[:self.used].copy_(host[:self.used], non_blocking=host.is_pinned())
        owner.num_copies += 1
        if self.device.type == "cuda":
            self.events[self.which] = torch.cuda.Event()
            self.events[self.which].record(torch.cuda.current_stream(self.device))
        self.which = (self.which + 1) % len(self.hosts)
        self.used, self.ready = 0, False

