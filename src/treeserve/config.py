"""Engine, cache and scheduler settings in one validated dataclass."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from pathlib import Path

import torch

from treeserve.errors import ParamError
from treeserve.speculative_config import SpeculativeConfig


def _integer(value) -> int | None:
    """`value` as an int where it is one (a Python or numpy integer; not a bool, a float or a string)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def in_unit_interval(value) -> bool:
    """Whether `value` is a number in (0, 1] (not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
          "float": torch.float32}
CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_KV_MEMORY_FRACTION = 0.25  # an LLM's KV on CPU where `cpu_kv_memory_fraction` is not given
ATTENTION_BACKENDS = ("auto", "triton", "torch")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # vLLM's names


@dataclass
class EngineConfig:
    model: str | Path
    tokenizer: str | Path | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = 2048  # None: the serving default (engine/token_budget.py)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9   # CUDA: share of total device memory this engine may use
    # CPU: share of available host memory for KV blocks alone, weights apart (cap 1 GiB); None: an LLM's
    # CPU_KV_MEMORY_FRACTION, a Runtime's `memory_utilization` rule (runtime/runtime.py)
    cpu_kv_memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"  # "auto" (Triton on CUDA, torch on CPU), "triton" or "torch"
    enforce_eager: bool = False      # CUDA: no CUDA graphs for decode steps
    # "auto": the checkpoint's weights, an untied embedding read in place from its file on CPU
    # (model/mapped_embedding.py); "safetensors": every weight copied into memory (a file rewritten
    # under a running server cannot reach it); "dummy": random weights made on the device (benchmarks)
    load_format: str = "auto"
    # Quantized weights (vLLM's `quantization`): None, what the checkpoint says ("gptq", "awq",
    # "compressed-tensors"); "int8": weight-only int8 made at load (model/quantization/)
    quantization: str | None = None
    # A step's text (detokenizing, RequestOutputs) made while the device runs the next step; None:
    # on CUDA only (on CPU nothing runs meanwhile).
    async_output_processing: bool | None = None
    # Async scheduling: step N+1 scheduled and launched before step N's sampled tokens reach the host
    # (its inputs take them on the device); None: on CUDA without tensor parallelism.
    async_scheduling: bool | None = None
    # Tensor parallelism: the model split over this many ranks (processes; one GPU each on CUDA)
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp": worker processes on this machine; "ray": Ray actors
    threads_per_rank: int | None = None       # CPU: torch threads per rank (default: the cores / ranks)
    # Speculative decoding (vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": 4, ...});
    # a dict is validated into a SpeculativeConfig
    speculative_config: SpeculativeConfig | dict | None = None
    # vLLM's `generation_config`: "auto" (the checkpoint's generation_config.json sets the default
    # sampling of requests that leave it out), "vllm" (treeserve's defaults; stop ids still the
    # checkpoint's), or a folder holding a generation_config.json to read instead
    generation_config: str | Path = "auto"
    # vLLM's cap on a request's `logprobs` / `prompt_logprobs` (-1, vLLM's, or None: the vocabulary, so
    # logprobs=-1 is taken; vLLM's default is 20, and its logprobs=-1 needs max_logprobs=-1)
    max_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if value is None and name == "max_num_batched_tokens":
                continue
            if not isinstance(value, int) or value < 1:
                raise ParamError(name, f"must be an integer >= 1, got {value!r}")
        if self.seed is None:  # (vLLM's V1 engine reads seed=None as 0, up to 0.12)
            self.seed = 0
        seed = _integer(self.seed)  # (numpy's integers too, as int() took them before)
        if seed is None or not -2 ** 63 <= seed < 2 ** 64:
            raise ParamError("seed", f"must be an integer in [-2**63, 2**64) (a 64-bit seed), got {self.seed!r}")
        self.seed = seed
        if self.max_logprobs is not None and (not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool)
                                              or self.max_logprobs < -1):
            raise ParamError("max_logprobs", f"must be an integer >= 0, or -1 for the whole vocabulary, "
                                             f"got {self.max_logprobs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ParamError("max_model_len", f"must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory_bytes is not None and (not isinstance(self.kv_cache_memory_bytes, int)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ParamError("kv_cache_memory_bytes", f"must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if not in_unit_interval(self.gpu_memory_utilization):
            raise ParamError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.cpu_kv_memory_fraction is not None and not in_unit_interval(self.cpu_kv_memory_fraction):
            raise ParamError("cpu_kv_memory_fraction", f"must be in (0, 1] (a share of the available host memory), "
                                                       f"got {self.cpu_kv_memory_fraction!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES and not isinstance(self.dtype, torch.dtype):
            raise ParamError("dtype", f"must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ParamError("attention_backend",
                             f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ParamError("tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ParamError("distributed_executor_backend",
                             f"must be 'mp' or 'ray', got {self.distributed_executor_backend!r}")
        if self.threads_per_rank is not None and (not isinstance(self.threads_per_rank, int) or self.threads_per_rank < 1):
            raise ParamError("threads_per_rank", f"must be an integer >= 1, got {self.threads_per_rank!r}")
        for name in ("async_output_processing", "async_scheduling"):
            if getattr(self, name) not in (None, True, False):
                raise ParamError(name, f"must be true, false or null, got {getattr(self, name)!r}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ParamError("quantization", f"must be a method's name or null, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ParamError("load_format", f"must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not isinstance(self.generation_config, (str, Path)) or not str(self.generation_config):
            raise ParamError("generation_config", f"must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if str(self.device) not in ("auto", "cpu") and not str(self.device).startswith("cuda"):
            raise ParamError("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ParamError("device", f"{self.device!r} requested but CUDA is not available")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cuda":
            return cuda_auto_dtype(checkpoint_dtype, torch.cuda.is_bf16_supported())
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cuda_auto_dtype(checkpoint_dtype: str | None, bf16_supported: bool) -> torch.dtype:
    """vLLM's `dtype="auto"` on a GPU: a float32 (or unnamed) checkpoint runs in the device's half
    type, bfloat16 where it has bfloat16 units (compute capability 8.0 on) and float16 before; a
    bfloat16 checkpoint falls back to float16 on a GPU without them; float16 stays float16."""
    half = torch.bfloat16 if bf16_supported else torch.float16
    dtype = DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if dtype == torch.float32 or (dtype == torch.bfloat16 and not bf16_supported):
        return half
    return dtype


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast only with AMX or AVX512-BF16; without them they are ~100x slower than fp32."""
    return cpu_has_amx() or "avx512_bf16" in _cpu_flags()


def cpu_has_amx() -> bool:
    """AMX tiles for bfloat16 (oneDNN's matmuls run on them: several times the vector units' rate)."""
    return "amx_bf16" in _cpu_flags()


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo, read once (the MoE forward asks `cpu_has_fast_bf16` every step)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
