"""How many KV blocks fit in the memory budget."""
from __future__ import annotations

from pathlib import Path

import torch

from treeserve.config import CPU_DEFAULT_KV_BYTES, CPU_KV_MEMORY_FRACTION, EngineConfig
from treeserve.errors import ParamError


def available_host_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_budget_bytes(config: EngineConfig, device: torch.device, activation_bytes: int = 0) -> int:
    """Bytes for KV blocks: explicit, else a share of free host memory (CPU) or of the device (CUDA)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes
        if budget <= 0:
            raise ParamError(
                "gpu_memory_utilization", f"{config.gpu_memory_utilization} leaves no memory for the KV cache "
                f"({(total - free) >> 20} MiB in use, {activation_bytes >> 20} MiB for activations)"
            )
        return budget
    fraction = config.cpu_kv_memory_fraction
    return cpu_kv_bytes(CPU_KV_MEMORY_FRACTION if fraction is None else fraction)


def cpu_kv_bytes(fraction: float) -> int:
    """Bytes for KV blocks on CPU: `fraction` of the available host memory (read after the weights are
    loaded: they are not in it), at most CPU_DEFAULT_KV_BYTES."""
    return min(CPU_DEFAULT_KV_BYTES, int(available_host_bytes() * fraction))
