"""A model loaded for serving: its weights on the device, tokenizer, generation defaults and limits,
and the tensor-parallel workers holding its other shards. No KV memory yet: an engine is built from
a loaded model and the KV space it serves from (`LLMEngine(loaded, space)`), so a `Runtime` can
load every model, measure them, and only then size and create the space they share."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from treeserve.config import EngineConfig
from treeserve.engine.kv_arena import kv_bytes_per_token
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.memory import kv_budget_bytes
from treeserve.engine.token_budget import lone_request_budget, serving_token_budget
from treeserve.engine.tp_start import start_executor
from treeserve.engine.tp_worker import ModelSpec, prepare_kernels
from treeserve.errors import ParamError
from treeserve.model.backends import make_backend, resolve_backend_name
from treeserve.model.generation_config import load_generation_defaults
from treeserve.model.hf_config import ModelConfig, load_model_config
from treeserve.model.loader import build_model
from treeserve.model.parallel import ShardPlan, TensorParallel
from treeserve.model.quantization import check_device, resolve_quantization
from treeserve.model.release import release_weights
from treeserve.model.registry import resolve_model_path
from treeserve.model.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: EngineConfig
    name: str  # namespaces this model's prefix-cache hashes (several models may share one pool)
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Any
    generation_defaults: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    shared_num_batched_tokens: int  # the most tokens one step holds (the budget with several requests)
    max_num_batched_tokens: int     # a lone request's step budget
    attention_backend: str
    quantization: str | None = None  # the scheme its weights run in (model/quantization/)
    model: Any = None
    executor: Any = None            # the tensor-parallel workers, if any
    owns_executor: bool = field(default=False)
    weights_released: bool = field(default=False)  # `release_weights` ran: the model is a husk

    @property
    def model_key(self) -> str:
        return self.name or "model"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The generation config's eos ids and the tokenizer's eos, as vLLM stops on both: a chat
        fine-tune's tokenizer often ends turns with a token its base's generation_config.json lacks."""
        ids, eos = self.generation_defaults.eos_token_ids, self.tokenizer.eos_token_id
        return ids if eos is None or eos in ids else (*ids, eos)

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank (its heads)."""
        return kv_bytes_per_token(self.model.kv_config, self.dtype)

    def standalone_kv_space(self) -> KVSpace:
        """A KV space of its own, sized by the config's memory settings."""
        page_bytes = self.config.block_size * self.kv_bytes_per_token()
        budget = kv_budget_bytes(self.config, self.device)
        return KVSpace.create(budget, page_bytes, self.device, self.config.enable_prefix_caching)

    def tokens_held_at_most(self, block_size: int) -> int:
        """KV one sequence may hold at once: all of max_model_len, or with a window on every layer
        the window, one step's chunk and the two blocks they may straddle."""
        window = self.model_config.kv_window
        if window is None:
            return self.max_model_len
        return min(self.max_model_len, window + self.max_num_batched_tokens + 2 * block_size)

    def block_size_in(self, space: KVSpace, scratch: bool = False) -> int:
        """The block size this model gets from the space's pages; a space too small for one whole
        sequence is an error (`scratch`: a space for one measured prefill, not for max_model_len)."""
        block_size = space.arena.block_size_for(self.model.kv_config, self.dtype)
        num_blocks = space.pool.num_blocks
        if not scratch and num_blocks * block_size < self.tokens_held_at_most(block_size):
            raise ParamError(
                "kv_cache_memory_bytes", f"room for {num_blocks} blocks ({num_blocks * block_size} tokens), "
                f"fewer than one sequence of max_model_len={self.max_model_len} holds; raise the KV budget or "
                "lower max_model_len"
            )
        return block_size

    def join_workers(self, space: KVSpace, block_size: int) -> None:
        """With tensor parallelism: the workers build their shards of this model over their arenas."""
        if self.executor is None:
            return
        prepare_kernels(self.device)  # rank 0 too, before the workers wait on it in a collective
        arena, config = space.arena, self.config
        self.executor.add_model(self.model_key, ModelSpec(
            str(self.model_dir), self.dtype, self.max_model_len, config.load_format, config.seed,
            self.attention_backend, block_size, arena.num_pages, arena.page_bytes, arena.serial, self.quantization))

    def close(self) -> None:
        """Stops the tensor-parallel workers it started (a `Runtime`'s own are the Runtime's to stop)."""
        if self.owns_executor and self.executor is not None:
            self.executor.shutdown()
            self.owns_executor = False

    def release_weights(self) -> None:
        """Frees this process's weights now (its owner's call, once no engine runs it), the engines
        that still hold the model included; the model's shape (`kv_config`) stays readable."""
        if self.model is not None and not self.weights_released:
            release_weights(self.model)
            self.model.backend = None
        self.weights_released = True


def load_model(config: EngineConfig, name: str = "", executor=None) -> LoadedModel:
    """Reads the checkpoint's config, tokenizer and defaults and builds the model on its device.
    `executor`: the tensor-parallel workers this model joins (a `Runtime`'s, shared by its models);
    with tensor_parallel_size > 1 and none given, it starts its own (stopped again if loading fails)."""
    return load_weights(describe_model(config, name, executor))


def load_weights(loaded: LoadedModel) -> LoadedModel:
    """Builds a described model's weights (and attention backend) on its device."""
    config = loaded.config
    torch.manual_seed(config.seed)
    try:
        loaded.model = build_model(loaded.model_dir, loaded.model_config, loaded.dtype, loaded.device,
                                   loaded.max_model_len, config.load_format, config.seed, _tensor_parallel(loaded),
                                   loaded.quantization)
        loaded.model.backend = make_backend(loaded.attention_backend, loaded.model.kv_config, loaded.dtype,
                                            loaded.device)
    except BaseException:
        loaded.close()
        raise
    return loaded


def describe_model(config: EngineConfig, name: str = "", executor=None) -> LoadedModel:
    """What a checkpoint is (config, tokenizer, defaults, limits, device and dtype), no weights yet."""
    model_dir = resolve_model_path(config.model)
    model_config = load_model_config(model_dir)
    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer, "tokenizer") if config.tokenizer else model_dir)
    device = config.resolve_device()
    dtype = config.resolve_dtype(device, model_config.torch_dtype)
    shared, lone = token_budgets(config, model_config, device)
    quantization = resolve_quantization(config.quantization, model_dir)
    check_device(quantization, device, dtype)
    generation = load_generation_defaults(model_dir, model_config, config.generation_config)
    if generation.sampling:
        logger.info("%s: default sampling parameters from the model's generation_config.json: %s "
                 "(--generation-config vllm leaves them out)", name or model_dir.name, generation.sampling)
    return LoadedModel(
        config, name, model_dir, model_config, tokenizer, generation,
        device, dtype, _max_model_len(config, model_config), shared, lone,
        resolve_backend_name(config.attention_backend, device, dtype), quantization, executor=executor)


def token_budgets(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> tuple[int, int]:
    """The most tokens one step holds with several requests, and for a lone request."""
    shared = config.max_num_batched_tokens or serving_token_budget(model_config, device)
    return shared, config.max_num_batched_tokens or lone_request_budget(shared)


def _tensor_parallel(loaded: LoadedModel) -> TensorParallel:
    """This process's rank (0) of the model's ranks; starts the workers where none are given."""
    size = loaded.config.tensor_parallel_size
    if size == 1:
        return TensorParallel()
    config = loaded.model_config
    ShardPlan.check(TensorParallel(0, size), config.num_heads, config.num_kv_heads, config.head_dim,
                    config.intermediate_size, config.vocab_size)  # before any process starts
    if loaded.executor is None:
        loaded.executor, loaded.owns_executor = start_executor(loaded.config, loaded.device), True
    return loaded.executor.tp


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    wanted = config.max_model_len
    if wanted is not None and wanted > limit:
        raise ParamError("max_model_len", f"{wanted} exceeds the model's max_position_embeddings ({limit})")
    return wanted or limit
