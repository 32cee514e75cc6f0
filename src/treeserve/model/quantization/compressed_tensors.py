"""llm-compressor's `compressed-tensors` checkpoints (see formats.py for the tensors)."""
from __future__ import annotations

import re

import torch

from treeserve.errors import ParamError
from treeserve.model.quantization.formats import CheckpointFormat, _bits, _plain_g_idx, _scales, unpack_int32
from treeserve.model.quantization.weights import FloatWeight, IntWeight

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith("." + target)


class CompressedTensorsFormat(CheckpointFormat):
    method = "compressed-tensors"
    markers = ("weight_packed", "weight_scale")
    tensors = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
               "input_scale", "input_zero_point")

    def __init__(self, config: dict):
        self.groups = list((config.get("config_groups") or {}).values())
        if not self.groups:
            raise ParamError("quantization", "compressed-tensors: the checkpoint's quantization_config has no "
                             "config_groups")
        if config.get("kv_cache_scheme"):
            raise ParamError("quantization", "compressed-tensors: a quantized KV cache (kv_cache_scheme) cannot be "
                             "loaded yet")
        for group in self.groups:
            fmt = group.get("format") or config.get("format")
            if fmt not in FORMATS:
                raise ParamError("quantization", f"compressed-tensors format {fmt!r} cannot be loaded (supported: "
                                 f"{', '.join(FORMATS)})")

    def scheme(self, prefix: str) -> dict:
        """The config group whose targets match this module (a named or regex target before 'Linear')."""
        named = [g for g in self.groups if any(t != "Linear" and _matches(t, prefix) for t in g.get("targets", ()))]
        linear = [g for g in self.groups if "Linear" in g.get("targets", ())]
        if not (named or linear):
            raise ParamError("quantization", f"compressed-tensors: no config group targets {prefix!r}")
        return (named or linear)[0]

    def decode(self, prefix: str, tensors: dict[str, torch.Tensor]) -> IntWeight | FloatWeight:
        scheme = self.scheme(prefix)
        weights, inputs = scheme.get("weights") or {}, scheme.get("input_activations")
        if weights.get("type", "int") == "float":
            return _decode_float(prefix, tensors, weights, inputs)
        return _decode_int(prefix, tensors, weights, inputs)


def _input_quant(prefix: str, inputs: dict | None, kind: str) -> str | None:
    """How a layer's inputs are quantized at run time (`kind`: the weights' type, int or float): not
    at all, per token (dynamic), or per tensor with a stored scale (static, FP8 only)."""
    if inputs is None:
        return None
    strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic")
    name = "fp8" if kind == "float" else "int8"
    if inputs.get("num_bits") == 8 and inputs.get("symmetric", True) and inputs.get("type", "int") == kind:
        if dynamic is True and strategy == "token":
            return f"{name}_token"
        if kind == "float" and dynamic is False and strategy == "tensor":
            return "fp8_tensor"
    raise ParamError("quantization", f"compressed-tensors: {prefix}'s input activations ({inputs.get('type')} "
                     f"{inputs.get('num_bits')} bits, strategy {strategy!r}, dynamic {dynamic}, symmetric "
                     f"{inputs.get('symmetric')}) cannot be run (supported: 8-bit symmetric per token, dynamic; "
                     "FP8 also per tensor, static)")


def _scales_per_group(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    scale = scale.float()
    if scale.numel() == 1:  # per tensor
        return scale.reshape(1, 1).expand(out_features, 1).contiguous()
    return scale.reshape(out_features, -1)


def _decode_int(prefix: str, tensors: dict, weights: dict, inputs: dict | None) -> IntWeight:
    bits = _bits(weights.get("num_bits"), f"compressed-tensors {prefix}")
    offset = 1 << (bits - 1)
    if "weight_packed" in tensors:
        out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
        values = unpack_int32(tensors["weight_packed"], bits)[:, :in_features].contiguous()
    else:
        values = (tensors["weight"].to(torch.int16) + offset).to(torch.uint8)
        out_features, in_features = values.shape
    scales = _scales_per_group(_scales(tensors, "weight_scale", f"compressed-tensors: {prefix}"), out_features)
    zeros = torch.full_like(scales, float(offset))
    if not weights.get("symmetric", True):  # asymmetric: the zero points are the checkpoint's
        zeros = _zero_points(tensors["weight_zero_point"], bits, scales.shape).float()
    group_size = in_features // scales.shape[1]
    if scales.shape[1] > 1 and weights.get("strategy") == "group":
        group_size = int(weights.get("group_size"))
    quant = _input_quant(prefix, inputs, "int")
    if quant is not None and (bits != 8 or scales.shape[1] != 1 or not bool((zeros == offset).all())):
        raise ParamError("quantization", f"compressed-tensors: {prefix}: int8 activations need symmetric 8-bit "
                         "weights with one scale per channel or tensor")
    return IntWeight(values, scales.contiguous(), zeros.contiguous(), bits, group_size,
                     _plain_g_idx(tensors.get("weight_g_idx"), group_size), quant)


def _zero_points(zero_point: torch.Tensor, bits: int, shape: torch.Size) -> torch.Tensor:
    """Asymmetric zero points in the unsigned values' units: packed over the output channels
    (int32, compressed-tensors >= 0.9) or as signed integers."""
    offset = 1 << (bits - 1)
    if zero_point.dtype == torch.int32 and bits < 8 and zero_point.shape[0] != shape[0]:
        return unpack_int32(zero_point.t(), bits)[:, :shape[0]].t().reshape(shape)
    return (zero_point.to(torch.int16) + offset).reshape(shape)


def _decode_float(prefix: str, tensors: dict, weights: dict, inputs: dict | None) -> FloatWeight:
    stored = tensors["weight"].dtype if "weight" in tensors else "packed"
    if weights.get("num_bits") != 8 or stored != torch.float8_e4m3fn:  # (NVFP4's 4-bit floats: packed)
        raise ParamError("quantization", f"compressed-tensors: {prefix}: float weights of {weights.get('num_bits')} "
                         f"bits ({stored}) cannot be loaded (supported: FP8 e4m3)")
    weight = tensors["weight"].float()
    scale = _scales(tensors, "weight_scale", f"compressed-tensors: {prefix}")
    if weights.get("strategy") == "block":  # [out / block rows, in / block columns]
        rows, cols = weights.get("block_structure") or (128, 128)
        scale = scale.repeat_interleave(rows, 0)[:weight.shape[0]].repeat_interleave(cols, 1)[:, :weight.shape[1]]
    elif weights.get("strategy") == "group":
        scale = scale.repeat_interleave(int(weights["group_size"]), 1)[:, :weight.shape[1]]
    else:
        scale = _scales_per_group(scale, weight.shape[0])
    quant = _input_quant(prefix, inputs, "float")
    input_scale = tensors.get("input_scale")
    return FloatWeight(weight * scale, quant, None if input_scale is None else input_scale.float().reshape(()))
