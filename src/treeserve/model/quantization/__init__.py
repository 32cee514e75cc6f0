"""Quantized weights: which scheme a model runs with, the checkpoint formats that store them, and
the linear layers that hold them.

The scheme is `EngineConfig.quantization` (vLLM's `quantization` / `--quantization`), by default
what the checkpoint's `config.json` says in its `quantization_config` (none: the weights as stored):

- `int8`: weight-only int8 made at load from a float or bfloat16 checkpoint (int8.py), the LM head
  too (int8_head.py);
- `gptq`, `awq`, `compressed-tensors`: checkpoints quantized by AutoGPTQ / GPTQModel, AutoAWQ and
  llm-compressor, read as formats.py and compressed_tensors.py describe, each decoder projection
  (fused qkv and gate/up with their parts' scales and zero points in row order) run by the layer
  layers.py picks: treeserve's int4 kernel (int4_csrc.py; PyTorch's, int4.py, where it cannot run),
  treeserve's int8 one, `torch._int_mm` for W8A8, or the
  weight dequantized at load where no kernel fits. MoE experts are dequantized at load to the
  activations' dtype (the stacked experts have no quantized kernels yet). Modules a checkpoint keeps
  unquantized (its `ignore` / `modules_to_not_convert`, e.g. the LM head) load as stored.

Everything runs on CPU so far (`check_device`), with tensor parallelism too: each rank decodes the
quantized modules whole and keeps its slice (`IntWeight.rows` / `columns`, model/sharding.py);
`int8` quantizes each rank's float shards. Where a scale is taken at load or run time over a
row-parallel projection's inputs (o_proj, down_proj: `int8`'s channel scales, W8A8's and dynamic
FP8's per-token activation scales) it is the whole row's, as one rank takes it: `int8`'s from the
checkpoint's whole rows (`checkpoint_reads.row_parallel_amax`), the activations' joined by an all-reduce of
the ranks' maxima (`activations.row_amax`); vLLM's ranks take their own share's instead.
"""
from treeserve.model.quantization.checkpoint import QuantizedTensors
from treeserve.model.quantization.int8 import (ATEN_INT8_MULTIPLE, DEQUANTIZE_FROM_ROWS, QUANTIZED_PROJECTIONS,
                                               Int8Linear, quantize_linears)
from treeserve.model.quantization.int8_head import Int8Embedding, quantize_lm_head
from treeserve.model.quantization.layers import quantized_layer
from treeserve.model.quantization.scheme import (QUANTIZATION_METHODS, check_device, checkpoint_format,
                                                 checkpoint_method, resolve_quantization)

__all__ = ["ATEN_INT8_MULTIPLE", "DEQUANTIZE_FROM_ROWS", "QUANTIZATION_METHODS", "QUANTIZED_PROJECTIONS",
           "Int8Embedding", "Int8Linear", "QuantizedTensors", "check_device", "checkpoint_format", "checkpoint_method",
           "quantize_linears", "quantize_lm_head", "quantized_layer", "resolve_quantization"]
