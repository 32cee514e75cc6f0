"""Reads a Hugging Face `config.json` into the one `ModelConfig` our model code understands.

Both layouts are accepted: published checkpoints carry `rope_theta` + `rope_scaling`, while
transformers 5 writes a single `rope_parameters` dict.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CAUSAL_LM_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Process reward models with a head of their own instead of the language-model head (model/heads.py):
# Qwen2.5-Math-PRM's two-class head per token, and a value head (one logit per token, Skywork's PRMs).
REWARD_ARCHITECTURES = {
    "Qwen2ForProcessRewardModel": "classify",
    "Qwen2ForPrmModel": "value",
}
SUPPORTED_ARCHITECTURES = CAUSAL_LM_ARCHITECTURES + tuple(REWARD_ARCHITECTURES)
_QWEN2_BODY = ("Qwen2ForCausalLM", "Qwen2ForProcessRewardModel", "Qwen2ForPrmModel", "Qwen2MoeForCausalLM")
_QWEN3_BODY = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MISTRAL_BODY = ("MistralForCausalLM", "MixtralForCausalLM")
_GEMMA_BODY = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Gemma 2 and 3 layers without `layer_types` in their config: every n-th layer global, the rest sliding
_GEMMA_GLOBAL_EVERY = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (model/moe.py): `num_experts` SwiGLU experts of `intermediate_size`,
    each token routed to the `top_k` with the highest softmax probability."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool          # the top-k weights renormalised to sum to 1 (Mixtral: always)
    weights_in_float32: bool      # the routing weights stay float32 (Mixtral) or take the model's dtype (Qwen)
    shared_expert_size: int = 0   # Qwen2-MoE: a dense expert every token takes, gated by a sigmoid
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP of intermediate_size
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ROPE_TYPE_ALIASES = {"su": "longrope", "yarn_phi3": "longrope"}  # early Phi-3 configs named LongRoPE "su"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # LongRoPE (Phi-3): per-frequency divisors for sequences up to / past the original length, and
    # the cos/sin scale (default sqrt(1 + ln(factor) / ln(original)), factor = max / original positions)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # One entry per layer: the sliding-window size, or None for full attention.
    sliding_windows: tuple[int | None, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    head: str = "lm"  # "lm" (next-token logits), "classify" (num_labels per token), "value" (one per token)
    num_labels: int = 2
    moe: MoEConfig | None = None
    # Gemma: GeGLU, RMSNorm by (1 + weight) in float32, the embedding scaled by sqrt(hidden); Gemma 2
    # and 3 normalise attention's and the MLP's outputs too ("sandwich"), Gemma 2 soft-caps scores
    hidden_act: str = "silu"
    gemma_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None          # the score scale (default head_dim ** -0.5)
    attn_softcap: float | None = None        # scores become c * tanh(score / c)
    final_softcap: float | None = None       # the same on the final logits
    local_rope: RopeConfig | None = None     # Gemma 3: the sliding-window layers' RoPE

    @property
    def kv_window(self) -> int | None:
        """Keys further back than this from the next query are read by no layer (the widest window,
        where every layer has one); None where some layer attends to everything."""
        windows = self.sliding_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    @property
    def output_width(self) -> int:
        """Columns of what the model computes per position: the vocabulary, or its head's outputs."""
        return {"lm": self.vocab_size, "classify": self.num_labels, "value": 1}[self.head]


def read_json(path: Path) -> dict[str, Any]:
    """Loads a JSON file, naming the file in every error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def rope_config(raw: dict[str, Any], path: Path) -> RopeConfig:
    """A config.json's RoPE (`rope_parameters`, or the older `rope_scaling` and `rope_theta`)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # Gemma 3 as transformers 5 writes it: one RoPE per layer type
        params = params["full_attention"]
    scaling = raw.get("rope_scaling") or {}
    return _rope_from({**scaling, **params}, raw, path)


def _local_rope(raw: dict[str, Any], arch: str, path: Path) -> RopeConfig | None:
    """Gemma 3's sliding-window layers: RoPE without scaling at `rope_local_base_freq` (10,000)."""
    if arch != "Gemma3ForCausalLM":
        return None
    params = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if params is None:
        params = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    return _rope_from(dict(params), raw, path)


def _rope_from(merged: dict[str, Any], raw: dict[str, Any], path: Path) -> RopeConfig:
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{path}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor other than 1 (rotary embedding on part of each head) is "
                         "not supported yet")
    original = merged.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    config = RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor") or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
    )
    return _longrope(config, merged, raw, path) if rope_type == "longrope" else config


def _longrope(config: RopeConfig, merged: dict[str, Any], raw: dict[str, Any], path: Path) -> RopeConfig:
    """LongRoPE's factors and cos/sin scale, as transformers computes them."""
    original = config.original_max_position_embeddings
    if not original or "short_factor" not in merged or "long_factor" not in merged:
        raise ValueError(f"{path}: longrope needs short_factor, long_factor and original_max_position_embeddings")
    factor = merged.get("factor") or raw.get("max_position_embeddings", original) / original
    scale = merged.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return replace(config, factor=float(factor), short_factor=tuple(map(float, merged["short_factor"])),
                   long_factor=tuple(map(float, merged["long_factor"])), attention_factor=float(scale))


def _sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in _GEMMA_GLOBAL_EVERY and window:
        every = int(raw.get("sliding_window_pattern", _GEMMA_GLOBAL_EVERY[arch]))
        return tuple(window if (i + 1) % every else None for i in range(num_layers))
    if arch in _MISTRAL_BODY or (arch == "Phi3ForCausalLM" and window):
        return (window,) * num_layers
    if arch in (*_QWEN2_BODY, *_QWEN3_BODY) and raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _moe_config(raw: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    # checkpoints name the expert count num_local_experts (Mixtral, transformers 5's Qwen3-MoE) or num_experts
    experts = int(raw["num_local_experts"] if "num_local_experts" in raw else raw["num_experts"]) if arch in (
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") else 0
    if arch == "MixtralForCausalLM":
        return MoEConfig(experts, int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]), True, True,
                         sparse_layers=(True,) * num_layers)
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(raw.get("shared_expert_intermediate_size", 0)) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                     bool(raw.get("norm_topk_prob", False)), False, shared, sparse)


def _gemma_fields(raw: dict[str, Any], arch: str, hidden: int, path: Path) -> dict[str, Any]:
    if arch not in _GEMMA_BODY:
        return {}
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention (an embedding model) is not supported")
    later = arch != "GemmaForCausalLM"
    scalar = raw.get("query_pre_attn_scalar")
    return dict(gemma_norms=True, sandwich_norms=later, embed_scale=hidden ** 0.5,
                attn_scale=float(scalar) ** -0.5 if later and scalar else None,
                attn_softcap=raw.get("attn_logit_softcapping") if later else None,
                final_softcap=raw.get("final_logit_softcapping") if later else None,
                local_rope=_local_rope(raw, arch, path))


def _activation(raw: dict[str, Any], arch: str, path: Path) -> str:
    """The MLP's gate activation: Gemma 2/3 name it hidden_activation; Gemma's legacy "gelu" means
    the tanh approximation (as transformers reads it)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if arch in _GEMMA_BODY and act == "gelu":
        act = "gelu_pytorch_tanh"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{path}: activation {act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    return act


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}: no 'architectures' field")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def parse_model_config(raw: dict[str, Any], path: Path = Path("config.json")) -> ModelConfig:
    arch = _architecture(raw, path)
    activation = _activation(raw, arch, path)
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=rope_config(raw, path),
            qkv_bias=arch in _QWEN2_BODY or bool(raw.get("attention_bias", False)),
            o_bias=arch not in _QWEN2_BODY and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in _QWEN3_BODY or arch == "Gemma3ForCausalLM",
            sliding_windows=_sliding_windows(raw, arch, num_layers),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            head=REWARD_ARCHITECTURES.get(arch, "lm"),
            num_labels=len(raw["id2label"]) if raw.get("id2label") else int(raw.get("num_labels", 2)),
            moe=_moe_config(raw, arch, num_layers),
            hidden_act=activation,
            **_gemma_fields(raw, arch, hidden, path),
        )
    except KeyError as exc:
        raise ValueError(f"{path}: missing required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        kind = "unsupported setting" if "not supported" in str(exc) else "malformed field"
        raise ValueError(f"{path}: {kind} ({exc})") from exc
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    return config


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found: {model_dir} is not a Hugging Face checkpoint "
                                f"directory{_checkpoint_below(model_dir)}")
    return parse_model_config(read_json(path), path)


def _checkpoint_below(folder: Path) -> str:
    """A hint where a folder above a checkpoint was given: a hub cache's model folder (its checkpoints
    are under snapshots/REVISION/), or a folder holding checkpoints."""
    found = sorted(folder.glob("snapshots/*/config.json")) or sorted(folder.glob("*/config.json"))
    return f"; did you mean {found[0].parent}?" if found else ""
