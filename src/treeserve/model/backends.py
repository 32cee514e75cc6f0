"""Which attention backend a model runs: `attention_backend="auto" | "triton" | "torch"`.

An explicit choice wins; "auto" defers to the environment variable `TREESERVE_ATTENTION_BACKEND`
where it is set, and otherwise means Triton on CUDA (where Triton is installed, as it is with CUDA
builds of PyTorch) and the torch backend on CPU. Both backends take the same calls
(`metadata_builder`, `forward`), so the runner never branches on the device.
"""
from __future__ import annotations

import os

import torch

from treeserve.config import ATTENTION_BACKENDS
from treeserve.errors import ParamError
from treeserve.model.attention import TorchSDPABackend, paged_prefill_max_context
from treeserve.model.hf_config import ModelConfig
from treeserve.model.kernels import interpreting, triton_installed

ENV_VAR = "TREESERVE_ATTENTION_BACKEND"

# Where decode attention gathers (no C kernel), on CPU a group's gathered keys are also capped: a
# large gather is a fresh allocation whose pages the kernel must fault in on every layer. Capped at
# a few thousand keys, one decode step's attention ran 1.75-5.8x faster at 144 sequences of ~160
# tokens and 4.2-5.7x at 480, across runs on a shared 2-core machine
# (benchmarks/decode_attention.py). CUDA's caching allocator has no such cost.
CPU_DECODE_GROUP_MAX_KEYS = 4096


def resolve_backend_name(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """'triton' or 'torch' for this device; a choice that cannot run here is a `ParamError`."""
    name = requested
    if name == "auto" and os.environ.get(ENV_VAR):
        name = os.environ[ENV_VAR]
        if name not in ATTENTION_BACKENDS:
            raise ParamError("attention_backend", f"{ENV_VAR}={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "torch"
    if name == "triton":
        _check_triton_can_run(device, dtype)
    return name


def _check_triton_can_run(device: torch.device, dtype: torch.dtype) -> None:
    if not triton_installed():
        raise ParamError("attention_backend", "'triton' needs the triton package (it ships with CUDA builds of "
                         "PyTorch; elsewhere pip install triton)")
    if device.type == "cuda":
        return
    if not interpreting():
        raise ParamError("attention_backend", f"'triton' on {device.type} runs only under Triton's interpreter "
                         "(set TRITON_INTERPRET=1; slow, meant for tests); use 'torch' or 'auto'")
    if dtype not in (torch.float32, torch.float16):
        raise ParamError("attention_backend", f"Triton's interpreter has no {dtype}: use dtype float32 or float16")


def make_backend(name: str, config: ModelConfig, dtype: torch.dtype, device: torch.device):
    """The backend object for a resolved name ('triton' or 'torch')."""
    if name == "triton":
        from treeserve.model.triton_backend import TritonBackend  # imports triton

        return TritonBackend(config, device)
    group_max_keys = CPU_DECODE_GROUP_MAX_KEYS if device.type == "cpu" else None
    paged_prefill = paged_prefill_max_context(dtype, config.num_heads, config.num_kv_heads,
                                              config.head_dim if device.type == "cpu" else 0)
    return TorchSDPABackend(paged_prefill, group_max_keys)
