"""Loads a local Hugging Face checkpoint directory: weights, generation defaults, tokenizer."""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from treeserve.errors import ParamError
from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.checkpoint_files import (checkpoint_tensor_names, iter_checkpoint_tensors, read_tensors,
                                             safetensors_files, tensor_names)
from treeserve.model.hf_config import ModelConfig, load_model_config, read_json
from treeserve.model.mapped_embedding import TARGET as EMBEDDING, map_embedding
from treeserve.model.moe import pack_experts
from treeserve.model.packed_linear import pack_linears, pack_tied_lm_head
from treeserve.model.parallel import ShardPlan, TensorParallel
from treeserve.model.quantization import (QuantizedTensors, checkpoint_format, quantize_linears, quantize_lm_head,
                                         quantized_layer)
from treeserve.model.quantization.int8_stream import StreamedInt8
from treeserve.model.quantization.weights import concat_rows
from treeserve.model.sharding import row_parallel, shard_quantized, shard_tensor

_FUSED = {  # checkpoint projection -> (our fused module, slot index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen2-MoE
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# one expert's projection (Mixtral's w1/w3/w2 under block_sparse_moe, Qwen-MoE's gate/up/down under mlp)
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


@dataclass
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)


def iter_checkpoint_shards(model_dir: Path, plan: ShardPlan,
                           whole: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor's part that this rank holds (the whole tensor without parallelism), or
    the whole tensor where `whole(name)` (quantized modules' packed tensors: sliced once decoded)."""
    if not plan.tp.enabled:
        yield from iter_checkpoint_tensors(model_dir)
        return

    def read(handle, name: str) -> torch.Tensor:
        if whole(name):
            return handle.get_tensor(name)
        return shard_tensor(*_target_name(name), handle.get_slice(name), plan)

    for path in safetensors_files(model_dir):
        yield from read_tensors(path, read)


def _target_name(name: str) -> tuple[str, int | None]:
    """Maps a checkpoint tensor name to our parameter name and, for fused projections, its slot."""
    match = _LAYER_NAME.match(name)
    if match:
        layer, module, kind = match.groups()
        module = re.sub(r"^block_sparse_moe\.", "mlp.", module)  # Mixtral's name for its MoE block
        if module in _FUSED:
            fused, slot = _FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", slot
        return f"layers.{layer}.{module}.{kind}", None
    if name.startswith("model."):
        return name[len("model."):], None
    return name, None


def _expert_piece(name: str) -> tuple[str, int, int | None] | None:
    """(stacked parameter, expert, 0 gate / 1 up / None down) for one expert's checkpoint tensor."""
    match = _LAYER_NAME.match(name)
    expert = _EXPERT.match(match.group(2)) if match and match.group(3) == "weight" else None
    if expert is None:
        return None
    index, projection = int(expert.group(1)), expert.group(2)
    stacked = "down_proj" if _EXPERT_PART[projection] is None else "gate_up_proj"
    return f"layers.{match.group(1)}.mlp.experts.{stacked}", index, _EXPERT_PART[projection]


def _copy_expert(param: torch.Tensor, expert: int, part: int | None, tensor: torch.Tensor, name: str) -> int:
    """Copies one expert's projection into its slice of the stacked parameter; returns how many
    such pieces fill the parameter."""
    if expert >= param.shape[0]:
        raise ValueError(f"tensor {name!r} names expert {expert}; the model has {param.shape[0]}")
    if part is None:
        _copy_into(param[expert], tensor, name)
        return param.shape[0]
    half = param.shape[1] // 2
    _copy_into(param[expert, part * half:(part + 1) * half], tensor, name)
    return 2 * param.shape[0]


class _WeightCopier:
    """Copies checkpoint tensors into the model's parameters: fused projections once all their parts
    arrived, experts into their stacked parameters; knows what is still missing."""

    def __init__(self, model: DecoderForCausalLM, model_dir: Path, mapped: frozenset[str] = frozenset()):
        self.model, self.model_dir = model, model_dir
        self.params = dict(model.named_parameters())
        self.pending: dict[str, dict[int, torch.Tensor]] = {}
        self.pieces: dict[str, set] = {}  # stacked expert parameters: the (expert, part) pieces copied so far
        self.mapped = mapped  # parameters over the checkpoint file's own pages (model/mapped_embedding.py)
        self.loaded: set[str] = set(mapped)

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        if _IGNORED.search(name) or (name == "lm_head.weight" and self.model.lm_head is None):
            return
        if (piece := _expert_piece(name)) is not None and piece[0] in self.params:
            target, expert, part = piece
            needed = _copy_expert(self.params[target], expert, part, tensor, name)
            self.pieces.setdefault(target, set()).add((expert, part))
            if len(self.pieces[target]) == needed:
                self.loaded.add(target)
            return
        target, slot = _target_name(name)
        if target in self.mapped:
            return
        if target not in self.params:
            raise ValueError(f"{self.model_dir}: unexpected tensor {name!r} in checkpoint")
        if slot is None:
            _copy_into(self.params[target], tensor, name)
            self.loaded.add(target)
            return
        parts = self.pending.setdefault(target, {})
        parts[slot] = tensor
        if len(parts) == _fused_parts(target):
            _copy_into(self.params[target], torch.cat([parts[i] for i in sorted(parts)]), name)
            self.loaded.add(target)
            del self.pending[target]

    def check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            names = [n for param in missing for n in checkpoint_names(param, self.pending.get(param, {}))]
            raise ValueError(f"{self.model_dir}: the checkpoint lacks the tensors "
                             f"{names[:5]}{'...' if len(names) > 5 else ''}")


def checkpoint_names(param: str, received: dict) -> list[str]:
    """The checkpoint's names (Hugging Face's) for what a parameter still lacks: a fused projection's
    missing parts (`model.layers.0.self_attn.k_proj.weight`, not our `qkv_proj`), else the one tensor."""
    match = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", param)
    if match:
        layer, module, kind = match.groups()
        parts = [m for m, (fused, slot) in _FUSED.items() if fused == module and slot not in received]
        if parts:
            return [f"model.layers.{layer}.{part}.{kind}" for part in parts]
    return [param if param.startswith("lm_head.") else f"model.{param}"]


def _fused_parts(target: str) -> int:
    return 3 if "qkv" in target else 2


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
    copier = _WeightCopier(model, model_dir, mapped)
    whole = quantized.owns if quantized is not None else (lambda name: False)
    parts: dict[str, dict[int, object]] = {}  # fused projections' decoded parts, until their last
    layers_read: set[str] = set()
    for name, tensor in iter_checkpoint_shards(model_dir, model.plan, whole):
        if (match := _LAYER_NAME.match(name)) is not None and match.group(1) not in layers_read:
            layers_read.add(match.group(1))
            if len(layers_read) % TRIM_EVERY_LAYERS == 0:
                release_freed_heap()
        if quantized is not None and quantized.owns(name):
            complete = quantized.add(name, tensor)
            if complete is not None:
                _install_quantized(model, complete, quantized.decode(complete), copier, dtype, parts)
        else:
            target, slot = _target_name(name)
            if streamed is not None and streamed.owns(target):
                streamed.add(target, slot, _fused_parts(target), tensor)
            else:
                copier.copy(name, tensor)
    if quantized is not None:
        for prefix, weight in quantized.decoded():  # (a module lacking a tensor: its error names it)
            _install_quantized(model, prefix, weight, copier, dtype, parts)
        if parts:
            raise ValueError(f"quantized checkpoint: fused projections with missing parts: {sorted(parts)[:3]}")
    if streamed is not None and streamed.missing():
        raise ValueError(f"{model_dir}: checkpoint is missing tensors for {streamed.missing()[:5]}")
    copier.check_complete()


def _quantized_targets(model: nn.Module, quantized: QuantizedTensors) -> list[str]:
    """Our modules (fused names) that quantized checkpoint modules fill, experts aside."""
    targets = set()
    for prefix in quantized.modules:
        if _expert_piece(prefix + ".weight") is None:
            targets.add(_target_name(prefix + ".weight")[0].removesuffix(".weight"))
    for target in targets:
        if target == "lm_head" and model.lm_head is None and model.head_name is None:
            raise ParamError("quantization", "lm_head is quantized in the checkpoint, but its config ties the LM head "
                             "to the embeddings (tie_word_embeddings: true): set it false for this checkpoint")
        try:
            module = model.get_submodule(target)
        except AttributeError:
            raise ValueError(f"quantized checkpoint: unexpected quantized module {target!r}") from None
        if not isinstance(module, nn.Linear):
            raise ParamError("quantization", f"{target} is quantized in the checkpoint, and treeserve loads "
                             "quantized weights into linear projections only")
    return sorted(targets)


def _install_quantized(model: DecoderForCausalLM, prefix: str, weight, copier: _WeightCopier, dtype: torch.dtype,
                       parts: dict[str, dict[int, object]]) -> None:
    """One decoded quantized module: a projection replaced by its quantized layer (`quantized_layer`;
    a fused one's part kept in `parts` until the last arrives), an expert dequantized into its
    stacked parameter."""
    if _expert_piece(prefix + ".weight") is not None:
        copier.copy(prefix + ".weight", weight.dequantize(torch.float32))
        return
    target, slot = _target_name(prefix + ".weight")
    weight = shard_quantized(target, slot, weight, model.plan)
    module = target.removesuffix(".weight")
    pieces = parts.setdefault(module, {})
    pieces[0 if slot is None else slot] = weight
    if slot is None or len(pieces) == _fused_parts(module):
        _replace_linear(model, module, concat_rows([pieces[i] for i in sorted(pieces)]), dtype)
        del parts[module]


def _replace_linear(model: nn.Module, module: str, weight, dtype: torch.dtype) -> None:
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    if weight.shape != (old.out_features, old.in_features):
        raise ValueError(f"quantized weight for {module} has shape {weight.shape}, expected "
                         f"{(old.out_features, old.in_features)}")
    split_inputs = model.plan.tp if model.plan.tp.enabled and row_parallel(module + ".weight") else None
    setattr(parent, child, quantized_layer(weight, old.bias, dtype, split_inputs))


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    if param.is_floating_point() and (not tensor.is_floating_point() or tensor.element_size() == 1):
        # (int8, FP8: quantized values, which without their scales would load as garbage)
        raise ValueError(f"tensor {name!r} is {tensor.dtype}, quantized values without the scales that read them "
                         f"(is its module's weight_scale missing from the checkpoint?): it cannot load as a plain "
                         f"{param.dtype} weight")
    with torch.no_grad():
        param.copy_(tensor)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialised storage for every tensor built on "meta" (floating ones in `dtype`): what
    `to_empty(device).to(dtype)` does, without its per-tensor Python references (their first call
    imports torch's symbolic shapes and sympy, ~1 s of a start) nor a second copy for the dtype."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = empty(buffer)


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
    quantized = _quantized_tensors(model, model_dir, quantization) if load_format != "dummy" else None
    channel_amax = row_parallel_amax(model_dir, model.plan, dtype) if quantization == "int8" and tp.enabled else None
    streamed = StreamedInt8(model, dtype, channel_amax) if quantization == "int8" and load_format != "dummy" else None
    mapped = load_format == "auto" and map_embedding(model, lambda: _checkpoint_tensor(model_dir, EMBEDDING),
                                                     dtype, device)
    _materialize(model, device, dtype)
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


def release_freed_heap() -> None:
    """Hands the heap pages a load freed back to the system. glibc keeps freed chunks under its mmap
    threshold (at most 32 MiB: decoded 4-bit words, packing buffers, a fused projection's parts) in
    its heap, so a 4-bit load of the 1B shape held 0.23 GiB more than its weights; `malloc_trim`
    releases their whole pages. Elsewhere than glibc: nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def row_parallel_amax(model_dir: Path, plan: ShardPlan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each row-parallel projection's (o_proj, down_proj) largest absolute weight per output channel
    over the whole row, as `dtype` holds the weights (module name -> float32 [out]): on-the-fly int8
    scales them as one rank would, although each rank holds a share of the row. Read one tensor at
    a time."""
    def wanted(name: str) -> bool:
        target = _target_name(name)[0]
        return row_parallel(target) and ".experts." not in target

    return {_target_name(name)[0].removesuffix(".weight"): tensor.to(dtype).float().abs().amax(dim=1)
            for name, tensor in iter_checkpoint_tensors(model_dir, wanted)}


def _quantized_tensors(model: nn.Module, model_dir: Path, method: str | None) -> QuantizedTensors | None:
    """The gatherer of a quantized checkpoint's tensors (None for other checkpoints); the float
    weights of the projections it fills are dropped before they are ever allocated."""
    fmt = checkpoint_format(model_dir, method) if method is not None else None
    if fmt is None:
        return None
    quantized = QuantizedTensors(fmt, checkpoint_tensor_names(model_dir))
    if not quantized.modules:
        raise ParamError("quantization", f"{model_dir}: the checkpoint is quantized with {method!r}, but none of its "
                         f"tensors is ({', '.join(fmt.markers)} not found)")
    for target in _quantized_targets(model, quantized):
        model.get_submodule(target).weight = None  # replaced by the quantized layer once loaded
    return quantized


def _checkpoint_tensor(model_dir: Path, target: str) -> tuple[Path, str] | None:
    """(the file, the checkpoint's name) of the tensor that fills our parameter `target`; None where
    no file holds one."""
    for path in safetensors_files(model_dir):
        for name in tensor_names(path):
            if _target_name(name) == (target, None):
                return path, name
    return None


@torch.no_grad()
def init_dummy_weights(model: DecoderForCausalLM, seed: int, std: float = 0.02) -> None:
    """Norm weights 1 (Gemma's, which scale by 1 + w: 0), biases 0, every other weight normal(0, std)
    (transformers' initialiser)."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(0.0 if model.config.gemma_norms else 1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model_dir: Path, config: ModelConfig, source: str | Path = "auto") -> GenerationDefaults:
    """Stop ids and default sampling from a generation_config.json, as vLLM's `--generation-config`:
    "auto" reads the checkpoint's (its sampling fields become the defaults of requests that leave them
    out), "vllm" the checkpoint's stop ids only (treeserve's own sampling defaults), a folder its own
    generation_config.json."""
    folder = model_dir if str(source) in ("auto", "vllm") else Path(source)
    path = folder / "generation_config.json"
    if folder != model_dir and not path.is_file():
        raise ParamError("generation_config", f"{path}: file not found (give 'auto', 'vllm' or a folder holding one)")
    raw = read_json(path) if path.is_file() else {}
    eos = raw.get("eos_token_id", None)
    if eos is None:
        eos_ids = config.eos_token_ids
    else:
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos)
    sampling = {ours: raw[theirs] for theirs, ours in GENERATION_SAMPLING_KEYS.items() if raw.get(theirs) is not None}
    if raw.get("do_sample") is False:
        sampling["temperature"] = 0.0
    if str(source) == "vllm":
        sampling = {}
    return GenerationDefaults(eos_token_ids=tuple(int(e) for e in eos_ids), sampling=sampling)


def _light_config(model_dir: Path, named: dict) -> dict:
    """`config=` for AutoTokenizer where the tokenizer's class is named in tokenizer_config.json.

    AutoTokenizer otherwise builds the model's full transformers config, whose import costs ~2 s of
    every server's start; it reads only the model type and name from it, which a plain
    PretrainedConfig carries. Without a named class (or with remote code) it keeps its own way.
    """
    config = model_dir / "config.json"
    if not named or not config.is_file():
        return {}
    raw = read_json(config)
    if not named.get("tokenizer_class") or "auto_map" in named or "auto_map" in raw or not raw.get("model_type"):
        return {}
    from transformers import PretrainedConfig

    light = PretrainedConfig(name_or_path=str(model_dir), tokenizer_class=raw.get("tokenizer_class"))
    light.model_type = raw["model_type"]
    return {"config": light}


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'tokenizer.json'}: file not found (nor tokenizer_config.json)")
    if (model_dir / "tokenizer.json").is_file():
        read_json(model_dir / "tokenizer.json")  # names the file if it is malformed
    named = read_json(model_dir / "tokenizer_config.json") if (model_dir / "tokenizer_config.json").is_file() else {}
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **_light_config(model_dir, named))
    except Exception as exc:  # transformers raises many types; name the directory
        raise ValueError(f"{model_dir}: could not load the tokenizer ({exc})") from exc


__all__ = ["build_model", "load_generation_defaults", "load_tokenizer", "load_model_config", "GenerationDefaults"]
