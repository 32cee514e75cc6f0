"""A model built from a local Hugging Face checkpoint directory: made on "meta", given storage, filled
from the checkpoint (or with dummy weights), quantized and packed for the device.

The pieces live beside it: checkpoint names (weight_names.py), reads (checkpoint_reads.py), the load
loop (weight_loading.py), quantized modules (quantized_install.py), generation defaults
(generation_config.py) and the tokenizer (tokenizer.py), still importable from here."""
from __future__ import annotations

from pathlib import Path

import torch

from treeserve.model.checkpoint_reads import checkpoint_tensor, row_parallel_amax
from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.generation_config import GenerationDefaults, load_generation_defaults
from treeserve.model.heap import release_freed_heap
from treeserve.model.hf_config import ModelConfig, load_model_config
from treeserve.model.mapped_embedding import TARGET as EMBEDDING, map_embedding
from treeserve.model.materialize import init_dummy_weights, materialize
from treeserve.model.moe import pack_experts
from treeserve.model.packed_linear import pack_linears, pack_tied_lm_head
from treeserve.model.parallel import TensorParallel
from treeserve.model.quantization import quantize_linears, quantize_lm_head
from treeserve.model.quantization.int8_stream import StreamedInt8
from treeserve.model.quantized_install import quantized_tensors
from treeserve.model.tokenizer import load_tokenizer
from treeserve.model.weight_loading import load_weights


def build_model(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, load_format: str = "auto", seed: int = 0,
                tp: TensorParallel = TensorParallel(), quantization: str | None = None) -> DecoderForCausalLM:
    """`load_format="dummy"`: random weights made on the device, no checkpoint read (vLLM's name;
    for benchmarks of large shapes: the directory needs only config.json and a tokenizer);
    "safetensors": every weight copied into memory, an untied embedding too (with "auto" it is read
    in place from the file on CPU).
    `quantization`: the scheme the weights are quantized with once loaded (model/quantization/)."""
    with torch.device("meta"):
        model = DecoderForCausalLM(config, max_positions, tp)
    quantized = quantized_tensors(model, model_dir, quantization) if load_format != "dummy" else None
    channel_amax = row_parallel_amax(model_dir, model.plan, dtype) if quantization == "int8" and tp.enabled else None
    streamed = StreamedInt8(model, dtype, channel_amax) if quantization == "int8" and load_format != "dummy" else None
    mapped = load_format == "auto" and map_embedding(model, lambda: checkpoint_tensor(model_dir, EMBEDDING),
                                                     dtype, device)
    materialize(model, device, dtype)
    # RoPE tables stay in float32 (as in transformers); the decoder computed them on the CPU
    for rotary in (model.rotary, model.local_rotary):
        if rotary is not None:
            rotary.to(device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir, quantized, dtype, streamed, frozenset({EMBEDDING}) if mapped else frozenset())
    quantize_linears(model, quantization, channel_amax)  # (random weights: what no checkpoint streamed)
    quantize_lm_head(model, quantization)
    pack_linears(model, dtype, device)
    pack_tied_lm_head(model, dtype, device)
    pack_experts(model, dtype, device)
    release_freed_heap()
    return model.eval()


__all__ = ["build_model", "load_generation_defaults", "load_tokenizer", "load_model_config", "GenerationDefaults"]
