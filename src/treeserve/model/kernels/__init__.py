"""Triton kernels for the GPU path: paged attention over the flat batch and the K/V write by slot.

Triton ships with CUDA builds of PyTorch; on CPU the kernels run only under Triton's interpreter
(`TRITON_INTERPRET=1`, read when a kernel module is first imported), which is how the tests check
them without a GPU. Nothing here is imported unless the Triton attention backend is chosen.
"""
from __future__ import annotations

import importlib.util
import os


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
