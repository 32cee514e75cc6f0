"""A checkpoint's tensors read into a model built on it, tensor by tensor: float ones copied into their
parameters, quantized modules installed as each is decoded, on-the-fly int8's projections quantized as
they are read."""
from __future__ import annotations

from pathlib import Path

import torch

from treeserve.model.checkpoint_reads import iter_checkpoint_shards
from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.heap import release_freed_heap
from treeserve.model.quantization import QuantizedTensors
from treeserve.model.quantization.int8_stream import StreamedInt8
from treeserve.model.quantized_install import install_quantized
from treeserve.model.weight_copier import WeightCopier
from treeserve.model.weight_names import LAYER_NAME, fused_parts, target_name

# layers read between two `release_freed_heap` calls: each returns the load's transients so far
# (decoded 4-bit words, packing buffers), and the next layers fault fresh pages in where they would
# have reused those. The 1B shape's 4-bit load (16 layers): trimmed only at its end, its peak was
# 0.17 GiB over what it holds; at every layer 0.01 GiB, 1.0 s slower (7.2 s); every fourth 0.08, 0.2 s
TRIM_EVERY_LAYERS = 4


def load_weights(model: DecoderForCausalLM, model_dir: Path, quantized: QuantizedTensors | None = None,
                 dtype: torch.dtype = torch.float32, streamed: StreamedInt8 | None = None,
                 mapped: frozenset[str] = frozenset()) -> None:
    """Copies the checkpoint into the model; with tensor parallelism each float tensor is read only as
    far as this rank's shard of it (safetensors slices), never whole. `quantized`: gathers the quantized
    modules' tensors, installed once read as quantized layers for activations of `dtype`. With tensor
    parallelism every rank reads those whole and keeps its slice of each decoded weight
    (model/sharding.py). Each quantized module is decoded and installed as soon as its tensors are
    read, so a load holds one module's packed tensors (a fused projection's parts, until its last)
    beside the decoded weights. `streamed`: on-the-fly int8's projections, quantized as they are read.
    `mapped`: parameters already over the file's pages (their tensors skipped)."""
    copier = WeightCopier(model, model_dir, mapped)
    whole = quantized.owns if quantized is not None else (lambda name: False)
    parts: dict[str, dict[int, object]] = {}  # fused projections' decoded parts, until their last
    layers_read: set[str] = set()
    for name, tensor in iter_checkpoint_shards(model_dir, model.plan, whole):
        if (match := LAYER_NAME.match(name)) is not None and match.group(1) not in layers_read:
            layers_read.add(match.group(1))
            if len(layers_read) % TRIM_EVERY_LAYERS == 0:
                release_freed_heap()
        if quantized is not None and quantized.owns(name):
            complete = quantized.add(name, tensor)
            if complete is not None:
                install_quantized(model, complete, quantized.decode(complete), copier, dtype, parts)
        else:
            target, slot = target_name(name)
            if streamed is not None and streamed.owns(target):
                streamed.add(target, slot, fused_parts(target), tensor)
            else:
                copier.copy(name, tensor)
    if quantized is not None:
        for prefix, weight in quantized.decoded():  # (a module lacking a tensor: its error names it)
            install_quantized(model, prefix, weight, copier, dtype, parts)
        if parts:
            raise ValueError(f"quantized checkpoint: fused projections with missing parts: {sorted(parts)[:3]}")
    if streamed is not None and streamed.missing():
        raise ValueError(f"{model_dir}: checkpoint is missing tensors for {streamed.missing()[:5]}")
    copier.check_complete()
