"""Hugging Face checkpoint tensor names mapped to our parameter names: fused projections (q/k/v into
qkv_proj, gate/up into gate_up_proj) with each part's slot, experts into their stacked parameters,
and back again for the names an error shows."""
from __future__ import annotations

import re

FUSED = {  # checkpoint projection -> (our fused module, slot index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen2-MoE
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# one expert's projection (Mixtral's w1/w3/w2 under block_sparse_moe, Qwen-MoE's gate/up/down under mlp)
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}
IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def target_name(name: str) -> tuple[str, int | None]:
    """Maps a checkpoint tensor name to our parameter name and, for fused projections, its slot."""
    match = LAYER_NAME.match(name)
    if match:
        layer, module, kind = match.groups()
        module = re.sub(r"^block_sparse_moe\.", "mlp.", module)  # Mixtral's name for its MoE block
        if module in FUSED:
            fused, slot = FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", slot
        return f"layers.{layer}.{module}.{kind}", None
    if name.startswith("model."):
        return name[len("model."):], None
    return name, None


def expert_piece(name: str) -> tuple[str, int, int | None] | None:
    """(stacked parameter, expert, 0 gate / 1 up / None down) for one expert's checkpoint tensor."""
    match = LAYER_NAME.match(name)
    expert = _EXPERT.match(match.group(2)) if match and match.group(3) == "weight" else None
    if expert is None:
        return None
    index, projection = int(expert.group(1)), expert.group(2)
    stacked = "down_proj" if _EXPERT_PART[projection] is None else "gate_up_proj"
    return f"layers.{match.group(1)}.mlp.experts.{stacked}", index, _EXPERT_PART[projection]


def checkpoint_names(param: str, received: dict) -> list[str]:
    """The checkpoint's names (Hugging Face's) for what a parameter still lacks: a fused projection's
    missing parts (`model.layers.0.self_attn.k_proj.weight`, not our `qkv_proj`), else the one tensor."""
    match = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", param)
    if match:
        layer, module, kind = match.groups()
        parts = [m for m, (fused, slot) in FUSED.items() if fused == module and slot not in received]
        if parts:
            return [f"model.layers.{layer}.{part}.{kind}" for part in parts]
    return [param if param.startswith("lm_head.") else f"model.{param}"]


def fused_parts(target: str) -> int:
    """How many checkpoint tensors make up a fused projection (q, k, v; gate, up)."""
    return 3 if "qkv" in target else 2
