"""Engine options over a model given already loaded (`Runtime({"gen": load_model(config)}, max_num_seqs=8)`).

vLLM's split: what its ModelConfig, LoadConfig, ParallelConfig and DeviceConfig say is fixed when the
weights are loaded; its CacheConfig, SchedulerConfig and speculative config are an engine's, built
over those weights. Here the engine's apply to the engines a Runtime builds over the loaded model
(a copy of it: the caller's stays as it was), and a load-level one is a ParamError naming it unless
it equals what the model was loaded with (a lower `max_model_len` applies: the tables hold it).
"""
from __future__ import annotations

import dataclasses

import torch

from treeserve.errors import ParamError
from treeserve.engine.loaded_model import LoadedModel, token_budgets

# the engine's: its KV cache, its scheduler, its decode graphs, speculation, its request limits
ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes",
                  "gpu_memory_utilization", "cpu_kv_memory_fraction", "enable_prefix_caching", "enforce_eager",
                  "async_output_processing", "async_scheduling", "speculative_config", "max_logprobs")
# fixed when the weights were loaded: what they are, where, in which dtype and layout, over which ranks
LOAD_OPTIONS = ("model", "tokenizer", "dtype", "device", "max_model_len", "seed", "attention_backend", "load_format",
                "quantization", "tensor_parallel_size", "distributed_executor_backend", "threads_per_rank",
                "generation_config")


def with_engine_options(loaded: LoadedModel, options: dict) -> LoadedModel:
    """A copy of `loaded` whose engines take `options` (EngineConfig's fields)."""
    for name in LOAD_OPTIONS:
        if name in options and name != "max_model_len" and not _as_loaded(loaded, name, options[name]):
            raise ParamError(name, f"{options[name]!r} cannot apply to {loaded.model_key!r}: it was fixed when the "
                                   f"model was loaded ({_loaded_value(loaded, name)!r}); load it with {name}="
                                   f"{options[name]!r}, or give the Runtime the model's path")
    engine = {name: value for name, value in options.items() if name in ENGINE_OPTIONS}
    config = dataclasses.replace(loaded.config, **engine)  # (validated as EngineConfig validates)
    shared, lone = token_budgets(config, loaded.model_config, loaded.device)
    copy = dataclasses.replace(loaded, config=config, shared_num_batched_tokens=shared, max_num_batched_tokens=lone)
    if "max_model_len" in options:
        copy.max_model_len = _max_model_len(loaded, options["max_model_len"])
        copy.config = dataclasses.replace(config, max_model_len=copy.max_model_len)
    return copy


def _as_loaded(loaded: LoadedModel, name: str, value) -> bool:
    config = loaded.config
    if value == getattr(config, name):
        return True
    if name == "dtype":
        return dataclasses.replace(config, dtype=value).resolve_dtype(loaded.device, loaded.model_config.torch_dtype) \
            == loaded.dtype
    if name == "device":
        try:
            return _indexed(dataclasses.replace(config, device=value).resolve_device()) == _indexed(loaded.device)
        except ParamError:  # (CUDA asked for where there is none)
            return False
    if name == "quantization":
        return value == loaded.quantization
    return False


def _loaded_value(loaded: LoadedModel, name: str):
    return {"dtype": loaded.dtype, "device": loaded.device, "quantization": loaded.quantization}.get(
        name, getattr(loaded.config, name))


def _max_model_len(loaded: LoadedModel, value: int | None) -> int:
    """A length the loaded model's tables hold (at most the one it was loaded with)."""
    wanted = value if value is not None else loaded.model_config.max_position_embeddings
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 2:
        raise ParamError("max_model_len", f"must be an integer >= 2, got {value!r}")
    if wanted > loaded.max_model_len:
        raise ParamError("max_model_len", f"{wanted} cannot apply to {loaded.model_key!r}: it was fixed when the model "
                                          f"was loaded (its tables hold {loaded.max_model_len} tokens); load it with "
                                          f"max_model_len={wanted}, or give the Runtime the model's path")
    return wanted


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
