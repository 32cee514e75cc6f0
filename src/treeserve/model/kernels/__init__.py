"""Triton kernels for the GPU path: paged attention over the flat batch, the K/V write by slot (alone,
or with the rotary embedding in the same launch), the fused per-layer operations (RMSNorm +
residual, rotary, SiLU * up) and the grouped expert products of mixture-of-experts layers.

Triton ships with CUDA builds of PyTorch; on CPU the kernels run only under Triton's interpreter
(`TRITON_INTERPRET=1`, read when a kernel module is first imported), which is how the tests check
them without a GPU. Nothing here is imported unless the Triton attention backend is chosen or a layer runs on CUDA.
"""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

# The fused per-layer operations and grouped experts on CUDA; TREESERVE_FUSED_OPS=0 runs PyTorch's
# unfused ones instead.
FUSED_OPS = os.environ.get("TREESERVE_FUSED_OPS", "1") != "0"
# The Triton attention backend rotates q and k and writes k and v into the paged cache in one launch
# (`rotary_kv`); TREESERVE_FUSED_ROTARY_KV=0 (or TREESERVE_FUSED_OPS=0) runs the rotary and the K/V
# write as two. Read when a backend is built.
FUSED_ROTARY_KV = os.environ.get("TREESERVE_FUSED_ROTARY_KV", "1") != "0"


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


def grouped_experts_for(x) -> ModuleType | None:
    """`grouped_experts` where it serves this tensor (as `fused_ops_for`), else None."""
    if fused_ops_for(x) is None:
        return None
    from treeserve.model.kernels import grouped_experts
    return grouped_experts
