"""Quantized checkpoints of the tiny random models, for tests/test_quantized_checkpoints.py.

- compressed-tensors: written by the real library (`apply_quantization_config`, round-to-nearest
  min-max scales from its own `calculate_qparams`, `ModelCompressor.compress_model`), as
  llm-compressor's `oneshot` saves a round-to-nearest or dynamic scheme.
- GPTQ (v1) and AWQ (GEMM): GPTQModel and AutoAWQ do not install here without replacing torch, so
  these packers follow the formats' specifications (round-to-nearest, no Hessian: the format is what is
  tested). Each also writes a float checkpoint of the same integers dequantized in plain float32,
  `(q - z) * s`, computed before packing, never by treeserve's unpacker: the reference HF loads.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# decoder projections a quantizer converts (experts' too); routers, the LM head and embeddings stay
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.(.*\.)?"
                       r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _copy_model(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def _write(dest: Path, tensors: dict, quantization_config: dict | None) -> None:
    for old in dest.glob("model*.safetensors*"):
        old.unlink()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config, indent=2))


def _state(source: Path) -> dict:
    state = {}
    for path in sorted(source.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest over the groups `g_idx` names: (q uint [out, in], scales fp16 [groups, out],
    zeros int [groups, out]); GPTQ's rules: symmetric zero (2**bits) / 2, asymmetric zero >= 1 (a
    zero of 0 would be stored as -1 in GPTQ v1's minus-one format, which readers take for 2**bits)."""
    maxq = 2 ** bits - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, weight.shape[0])
    zeros = torch.empty(groups, weight.shape[0])
    for g in range(groups):
        w = weight[:, g_idx == g].float()
        low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        if sym:
            scale = torch.maximum(low.abs(), high) * 2 / maxq
            zero = torch.full_like(scale, (maxq + 1) / 2)
        else:
            scale = (high - low) / maxq
            zero = torch.round(-low / scale.clamp(min=1e-8)).clamp(1, maxq)
        scales[g] = scale.clamp(min=1e-8).half().float()
        zeros[g] = zero
    q = torch.round(weight.float() / scales[g_idx].t() + zeros[g_idx].t()).clamp(0, maxq).to(torch.int32)
    return q, scales.half(), zeros.to(torch.int32)


def dequantize_reference(q, scales, zeros, g_idx) -> torch.Tensor:
    return (q.float() - zeros[g_idx].t().float()) * scales[g_idx].t().float()


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [rows, cols] -> int32 [rows * bits / 32, cols]: row 32/bits * r + j at bits j * bits of row r."""
    per_word = 32 // bits
    values = values.to(torch.int64).reshape(-1, per_word, values.shape[1])
    words = torch.zeros(values.shape[0], values.shape[2], dtype=torch.int64)
    for j in range(per_word):
        words |= (values[:, j] & (2 ** bits - 1)) << (bits * j)
    return _as_int32(words)


def pack_columns(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int [rows, cols] -> int32 [rows, cols * bits / 32]: column c of 32/bits at bits j * bits, j its
    place in `order` (AWQ) or c itself."""
    per_word = 32 // bits
    values = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    words = torch.zeros(values.shape[0], values.shape[1], dtype=torch.int64)
    for j in range(per_word):
        column = order[j] if order else j
        words |= (values[:, :, column] & (2 ** bits - 1)) << (bits * j)
    return _as_int32(words)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def make_gptq(source: Path, dest: Path, reference: Path, bits: int = 4, group_size: int = 32, desc_act: bool = False,
              sym: bool = True, seed: int = 0, v2: bool = False, lm_head: bool = False) -> Path:
    """A GPTQ checkpoint of `source` at `dest` (format v1, zeros stored minus one; `v2`: as they are),
    its dequantized float twin at `reference`. `lm_head`: the LM head quantized too (GPTQModel's
    `lm_head=True`, its config's `"lm_head": true`; a model with an LM head of its own, untied)."""
    generator = torch.Generator().manual_seed(seed)
    state, packed, dequantized, orders = _state(source), {}, {}, {}
    for name, weight in state.items():
        if not (QUANTIZED.match(name) or (lm_head and name == "lm_head.weight")):
            packed[name] = dequantized[name] = weight
            continue
        prefix, in_features = name[:-len(".weight")], weight.shape[1]
        size = in_features if group_size == -1 else group_size
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[_act_order(orders, name, in_features, desc_act, generator)] = (torch.arange(in_features) // size).int()
        q, scales, zeros = quantize_rtn(weight, bits, size, sym, g_idx.long())
        packed[f"{prefix}.qweight"] = pack_rows(q.t(), bits)
        packed[f"{prefix}.qzeros"] = pack_columns(zeros if v2 else zeros - 1, bits)
        packed[f"{prefix}.scales"] = scales
        packed[f"{prefix}.g_idx"] = g_idx
        dequantized[name] = dequantize_reference(q, scales, zeros, g_idx.long())
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq_v2" if v2 else "gptq", "lm_head": lm_head}
    _write(_copy_model(source, dest), packed, config)
    _write(_copy_model(source, reference), dequantized, None)
    return dest


def _act_order(orders: dict, name: str, in_features: int, desc_act: bool, generator) -> torch.Tensor:
    """The order GPTQ quantizes a projection's input features in: by its Hessian's diagonal with
    `desc_act`, which depends on the input alone, so projections reading the same input (q, k, v;
    gate, up; one expert's gate and up) share it; here a random permutation per input."""
    if not desc_act:
        return torch.arange(in_features)
    shared = re.sub(r"(q_proj|k_proj|v_proj)\.weight$", "qkv", name)
    shared = re.sub(r"(gate_proj|up_proj|w1|w3)\.weight$", "gate_up", shared)
    if shared not in orders:
        orders[shared] = torch.randperm(in_features, generator=generator)
    return orders[shared]


def make_awq(source: Path, dest: Path, reference: Path, group_size: int = 32) -> Path:
    """An AWQ GEMM checkpoint (4 bits, zero points) of `source`, and its dequantized float twin."""
    state, packed, dequantized = _state(source), {}, {}
    for name, weight in state.items():
        if not QUANTIZED.match(name):
            packed[name] = dequantized[name] = weight
            continue
        prefix = name[:-len(".weight")]
        g_idx = torch.arange(weight.shape[1]) // group_size
        q, scales, zeros = quantize_rtn(weight, 4, group_size, False, g_idx)
        packed[f"{prefix}.qweight"] = pack_columns(q.t(), 4, AWQ_ORDER)
        packed[f"{prefix}.qzeros"] = pack_columns(zeros, 4, AWQ_ORDER)
        packed[f"{prefix}.scales"] = scales
        dequantized[name] = dequantize_reference(q, scales, zeros, g_idx)
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True,
              "modules_to_not_convert": ["lm_head"]}
    _write(_copy_model(source, dest), packed, config)
    _write(_copy_model(source, reference), dequantized, None)
    return dest


def make_compressed_tensors(source: Path, dest: Path, preset: str, group_size: int = 32, strategy: str | None = None,
                            ignore: tuple[str, ...] = ("lm_head",), input_scale: float = 4.0 / 448) -> Path:
    """`source` quantized with compressed-tensors' preset scheme (W4A16, W4A16_ASYM, W8A16, W8A8,
    FP8, FP8_DYNAMIC, ...), group-wise ones in groups of `group_size` (or the weights' `strategy`
    replaced), saved in the preset's format; static input scales (FP8) set to `input_scale`."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if strategy is not None:
        scheme.weights.strategy, scheme.weights.group_size = strategy, None
    if scheme.weights.strategy == "group":
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _set_weight_qparams(module, calculate_qparams)
                if hasattr(module, "input_scale"):
                    module.input_scale.fill_(input_scale)
    fmt = {"int": "pack-quantized", "float": "float-quantized"}[scheme.weights.type]
    if scheme.input_activations is not None and scheme.weights.type == "int":
        fmt = "int-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    dest.mkdir(parents=True)
    model.save_pretrained(dest)
    compressor.update_config(str(dest))
    for extra in source.iterdir():
        if extra.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(extra, dest / extra.name)
    return dest


def make_compressed_tensors_per_tensor(source: Path, dest: Path, group_size: int = 32) -> Path:
    """W4A16 (symmetric, groups of `group_size`) over the checkpoint's tensors, MoE experts included:
    compressed-tensors' own scales (`calculate_qparams`) and packing (`PackedQuantizationCompressor`)
    applied to each projection's weight, as llm-compressor does to the per-expert linears of the
    transformers versions that had them (5.x fuses a model's experts, so `make_compressed_tensors`
    leaves them as stored)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group_size
    packed = {}
    for name, weight in _state(source).items():
        if not QUANTIZED.match(name):
            packed[name] = weight
            continue
        grouped = weight.unflatten(-1, (-1, group_size))
        scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
        tensors = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
        packed.update({f"{name[:-len('.weight')]}.{k}": v for k, v in tensors.items()})
    _write(_copy_model(source, dest), packed, None)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="pack-quantized",
                                quantization_status=QuantizationStatus.COMPRESSED)
    ModelCompressor(quantization_config=config).update_config(str(dest))
    return dest


def _set_weight_qparams(module, calculate_qparams) -> None:
    args, weight = module.quantization_scheme.weights, module.weight
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        low, high = weight.amin(), weight.amax()
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))


def compressed_tensors_reference(checkpoint: Path, dest: Path) -> Path:
    """A float checkpoint of `checkpoint`'s weights as compressed-tensors' own decompressor
    dequantizes them (for schemes HF transformers cannot load itself, e.g. asymmetric W4A16)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    state, modules = _state(checkpoint), {}
    for name, tensor in state.items():
        prefix, _, suffix = name.rpartition(".")
        modules.setdefault(prefix, {})[suffix] = tensor
    plain = {}
    for prefix, tensors in modules.items():
        if "weight_packed" in tensors:
            plain[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(tensors, scheme)["weight"].float()
        else:
            plain.update({f"{prefix}.{k}": v for k, v in tensors.items()})
    _write(_copy_model(checkpoint, dest), plain, None)
    return dest
