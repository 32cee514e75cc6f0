"""Triton kernels for the GPU path: paged attention over the flat batch, the K/V write by slot, and
the fused per-layer operations (RMSNorm + residual, rotary, SiLU * up).

Triton ships with CUDA builds of PyTorch; on CPU the kernels run only under Triton's interpreter
(`TRITON_INTERPRET=1`, read when a kernel module is first imported), which is how the tests check
them without a GPU. Nothing here is imported unless the Triton attention backend is chosen or a layer runs on CUDA.
"""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

# The fused per-layer operations on CUDA; TREESERVE_FUSED_OPS=0 runs PyTorch's unfused ones instead.
FUSED_OPS = os.environ.get("TREESERVE_FUSED_OPS", "1") != "0"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_ops_for(x) -> ModuleType | None:
    """`fused_ops` where it serves this tensor (on CUDA, outside autograd), else None."""
    if x.device.type != "cuda" or x.requires_grad or not FUSED_OPS or not triton_installed():
        return None
    from treeserve.model.kernels import fused_ops
    return fused_ops
