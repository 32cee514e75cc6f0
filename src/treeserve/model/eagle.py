"""EAGLE draft heads (Li et al., arXiv 2401.15077 and 2503.01840) in their checkpoints' layout: one
Llama decoder layer that reads, beside each token's embedding, a feature of the target model.

- EAGLE (`eagle`): the feature is the target's final hidden state (after its norm); the layer's
  input is `fc([embedding, feature])` (2H -> H, a bias where the checkpoint has one), the layer has no
  input norm, its output (plus the residual) goes to the target's LM head as it is. Checkpoint:
  `fc.*`, `layers.0.{self_attn,mlp,post_attention_layernorm}.*` (an `embed_tokens` in it is ignored:
  the target's is used, as vLLM does).
- EAGLE-3 (`eagle3`): the feature is `fc` of three of the target's residual streams concatenated
  (entering its layers 2, L/2 and L-3 unless `eagle_config.eagle_aux_hidden_state_layer_ids` says
  otherwise; 3H -> H); the layer normalises the embedding (`input_layernorm`) and the feature
  (`hidden_norm`) and attends over both concatenated (2H -> q, k, v); a final `norm` and a head of
  its own over `draft_vocab_size` tokens, mapped to the target's ids by `d2t` (target = draft + d2t).
  Checkpoint: `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` (`t2d` unused).

From the second draft token on, the feature is the head's own output for the previous position
(EAGLE's "feature extrapolation"; EAGLE-3's pre-norm output). The head attends over its own KV
cache (one layer) through the engine's attention backend."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from treeserve.errors import ParamError
from treeserve.model.hf_config import ModelConfig, rope_config, read_json
from treeserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from treeserve.model.packed_linear import pack_linears

KINDS = ("eagle", "eagle3")


@dataclass(frozen=True)
class EagleConfig:
    kind: str
    layer: ModelConfig            # the head's decoder layer (and its KV: one layer)
    feature_size: int             # what `fc` reads: 2H (eagle: embedding + feature) or 3 x target H (eagle3)
    fc_bias: bool
    draft_vocab_size: int         # eagle3's own head (eagle: the target's vocabulary)
    aux_layers: tuple[int, ...]   # eagle3: the target layers whose input streams are the feature
    norm_before_residual: bool = False


def read_eagle_config(path: Path, kind: str, target: ModelConfig) -> EagleConfig:
    """The head's config.json, checked against the target it drafts for."""
    if kind not in KINDS:
        raise ParamError("speculative_config", f"method must be one of {', '.join(KINDS)} for an EAGLE head")
    raw = read_json(Path(path) / "config.json")
    hidden = int(raw.get("hidden_size", 0))
    heads = int(raw.get("num_attention_heads", 0))
    if not hidden or not heads:
        raise ParamError("speculative_config", f"{path}: config.json needs hidden_size and num_attention_heads")
    if hidden != target.hidden_size:
        raise ParamError("speculative_config", f"{path}: the head's hidden_size {hidden} is not the target's "
                         f"({target.hidden_size}); it reads the target's embeddings")
    layer = replace(target, architecture=f"{kind} head", hidden_size=hidden,
                    intermediate_size=int(raw.get("intermediate_size", 4 * hidden)), num_layers=1, num_heads=heads,
                    num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                    head_dim=int(raw.get("head_dim") or hidden // heads),
                    rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=rope_config(raw, Path(path)),
                    qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
                    mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=False, sliding_windows=(None,),
                    moe=None, gemma_norms=False, sandwich_norms=False, embed_scale=None, attn_scale=None,
                    attn_softcap=None, final_softcap=None, local_rope=None, hidden_act="silu")
    eagle_config = raw.get("eagle_config") or {}
    target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
    if kind == "eagle":
        return EagleConfig(kind, layer, 2 * hidden, False, target.vocab_size, ())
    n = target.num_layers
    aux = tuple(eagle_config.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))
    if len(aux) != 3 or not all(0 <= i < n for i in aux):
        raise ParamError("speculative_config", f"{path}: EAGLE-3 reads three of the target's {n} layers, got {aux}")
    return EagleConfig(kind, layer, 3 * target_hidden, False, int(raw.get("draft_vocab_size") or target.vocab_size),
                       aux, bool(raw.get("norm_before_residual", False)))


class EagleHead(nn.Module):
    """`forward(input_ids, features, positions, kv_cache, meta, backend)` -> (the rows' hidden states
    for the logits, their features for the next position)."""

    def __init__(self, config: EagleConfig, target: nn.Module, max_positions: int):
        super().__init__()
        layer = config.layer
        self.config, self.kind = config, config.kind
        self.target = [target]  # (a list: not a submodule; its embeddings and, for eagle, its LM head)
        hidden, self.head_dim = layer.hidden_size, layer.head_dim
        self.num_heads, self.num_kv_heads = layer.num_heads, layer.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention_in = 2 * hidden if self.kind == "eagle3" else hidden
        self.fc = nn.Linear(config.feature_size, hidden, bias=config.fc_bias)
        self.qkv_proj = nn.Linear(attention_in, self.q_size + 2 * self.kv_size, bias=layer.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=layer.o_bias)
        self.mlp = GatedMLP(hidden, layer.intermediate_size, layer.mlp_bias)
        self.post_attention_layernorm = RMSNorm(hidden, layer.rms_norm_eps)
        if self.kind == "eagle3":
            self.input_layernorm = RMSNorm(hidden, layer.rms_norm_eps)
            self.hidden_norm = RMSNorm(hidden, layer.rms_norm_eps)
            self.norm = RMSNorm(hidden, layer.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(layer.rope, self.head_dim, max_positions)
        self.scale = self.head_dim ** -0.5

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's rows (final hidden states, or eagle3's three streams) as the head's features."""
        return self.fc(hidden) if self.kind == "eagle3" else hidden

    def forward(self, input_ids, features, positions, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.target[0].embed_tokens(input_ids)
        if self.kind == "eagle":
            x = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
            residual = x
        else:
            features = features.to(embeds.dtype)
            if self.config.norm_before_residual:
                normed = residual = self.hidden_norm(features)
            else:
                residual, normed = features, self.hidden_norm(features)
            x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = self._attend(x, positions, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.kind == "eagle":
            out = x + residual
            return out, out
        return self.norm(x, residual)

    def _attend(self, x, positions, kv_cache, meta, backend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(kv_cache, q, k, v, meta, self.scale, None)
        return self.o_proj(out.reshape(-1, self.q_size))

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The head's most likely next token of each row, as the target's token id."""
        if self.kind == "eagle":
            return self.target[0].compute_logits(hidden)[:, :vocab_size].argmax(dim=-1)
        draft = self.lm_head(hidden).argmax(dim=-1)
        return draft + self.d2t[draft]


# ---- loading ---------------------------------------------------------------------------------
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1)}


def load_eagle_head(path: Path, config: EagleConfig, target: nn.Module, max_positions: int,
                    dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head with the checkpoint's weights (every `*.safetensors` in the folder) on the device."""
    tensors = _read_tensors(Path(path))
    head = EagleHead(_with_checkpoint_bias(config, tensors), target, max_positions)
    state, parts = {}, {}
    for name, tensor in tensors.items():
        mapped = _state_name(name)
        if mapped is None:
            continue
        key, index = mapped
        if index is None:
            state[key] = tensor.to(torch.long) if key == "d2t" else tensor
        else:
            parts.setdefault(key, {})[index] = tensor
    state |= {key: torch.cat([pieces[i] for i in sorted(pieces)]) for key, pieces in parts.items()}
    if config.kind == "eagle3":
        state.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # (none: the same ids)
    head.load_state_dict(state)
    head.to(device=device, dtype=dtype)
    with torch.device("cpu"):  # RoPE tables in float32, made again (the cast above rounded them)
        head.rotary = RotaryEmbedding(config.layer.rope, head.head_dim, max_positions)
    head.rotary.to(device)
    pack_linears(head, dtype, device)  # (the engine's CPU kernels, as the target's layers)
    return head.eval()


def check_eagle_checkpoint(path: Path, config: EagleConfig) -> None:
    """Every weight the head needs is in the folder's safetensors (names only: nothing is read)."""
    names = set()
    for file in _safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    with torch.device("meta"):
        wanted = set(EagleHead(_with_checkpoint_bias(config, names), nn.Module(), 1).state_dict())
    found = {mapped[0] for mapped in map(_state_name, names) if mapped is not None}
    optional = {"d2t"} if config.draft_vocab_size == config.layer.vocab_size else set()  # (the same ids)
    missing = sorted(wanted - found - optional)
    if missing:
        raise ParamError("speculative_config", f"{path}: the {config.kind} head's checkpoint lacks {', '.join(missing)}")


def _with_checkpoint_bias(config: EagleConfig, names) -> EagleConfig:
    """EAGLE's own checkpoints have a bias on fc; others (vLLM's, speculators') none."""
    return replace(config, fc_bias="fc.bias" in names) if config.kind == "eagle" else config


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ParamError("speculative_config", f"{path}: no *.safetensors file (the head's weights)")
    return files


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _state_name(name: str) -> tuple[str, int | None] | None:
    """A checkpoint name as the head's (key, part of a fused projection or None); None for what the
    head does not read. `model.`/`midlayer.`/`layers.0.`/`self_attn.` prefixes dropped; q/k/v and
    gate/up stacked as the fused projections."""
    short = name.removeprefix("model.").removeprefix("midlayer.").removeprefix("layers.0.")
    short = short.removeprefix("self_attn.")
    if short.startswith(("embed_tokens.", "t2d")):
        return None
    module, _, leaf = short.rpartition(".")
    projection = module.rpartition(".")[2]
    if projection in _FUSED:
        fused, index = _FUSED[projection]
        return f"{fused}.{leaf}", index
    return short, None
