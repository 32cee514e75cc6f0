"""One decoder-only transformer covering Llama (2/3/3.1/3.2), Mistral, Qwen2 and Qwen3, Phi-3,
Gemma (1/2/3), and the mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE: model/moe.py in place
of the MLP).

The families differ only in switches read from `ModelConfig`: qkv/o/mlp biases, q/k RMSNorm
(Qwen3, Gemma 3), sliding windows (Mistral, some Qwen2, every other layer of Gemma 2, five of six
of Gemma 3's, those with a RoPE of their own), RoPE scaling, tied embeddings, and Gemma's:
GeGLU, (1 + w) norms, a scaled embedding, norms around attention's and the MLP's outputs
("sandwich"), a query scale of its own, soft-capped attention scores and final logits. A process
reward model with a head of its own (model/heads.py) computes that head's outputs in place of logits.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from treeserve.model.attention import AttentionMetadata, TorchSDPABackend
from treeserve.errors import ParamError
from treeserve.model.heads import make_head
from treeserve.model.hf_config import ModelConfig
from treeserve.model.layers import GatedMLP, RotaryEmbedding, make_norm
from treeserve.model.moe import SparseMoeBlock
from treeserve.model.parallel import ShardPlan, TensorParallel, VocabParallelEmbedding


class Attention(nn.Module):
    """This rank's query and K/V heads (all of them without tensor parallelism); o_proj's partial
    sums are added across ranks."""

    def __init__(self, config: ModelConfig, window: int | None, plan: ShardPlan):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.tp = plan.local_heads, plan.local_kv_heads, plan.tp
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        def head_norm():
            return make_norm(self.head_dim, config.rms_norm_eps, config.gemma_norms) if config.qk_norm else None
        self.q_norm, self.k_norm = head_norm(), head_norm()
        # the channels the q, k and v projection may rotate itself (packed_linear.Bf16RotaryLinear):
        # q's and k's, where nothing comes between the projection and the rotation
        self.rotary_channels = 0 if config.qk_norm else (self.num_heads + self.num_kv_heads) * self.head_dim
        self.window = window
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.softcap = config.attn_softcap

    def forward(self, x, positions, rotary, layer_cache, meta, backend):
        rotated = getattr(self.qkv_proj, "applies_rotary", False)  # packed_linear.Bf16RotaryLinear
        qkv = self.qkv_proj(x, positions, rotary.cos, rotary.sin) if rotated else self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotated:
            out = backend.forward(layer_cache, q, k, v, meta, self.scale, self.window, self.softcap)
        elif backend.fuses_rotary:  # rotated in the backend's K/V write (the Triton backend)
            out = backend.forward(layer_cache, q, k, v, meta, self.scale, self.window, self.softcap,
                                  rotary=rotary.inputs(positions))
        else:
            q, k = rotary(positions, q, k)
            out = backend.forward(layer_cache, q, k, v, meta, self.scale, self.window, self.softcap)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None, plan: ShardPlan, sparse: bool = False):
        super().__init__()
        def norm():
            return make_norm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, window, plan)
        self.post_attention_layernorm = norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.sandwich = config.sandwich_norms
        if sparse:
            self.mlp = SparseMoeBlock(config.moe, config.hidden_size, config.mlp_bias)
        else:
            self.mlp = GatedMLP(config.hidden_size, plan.local_intermediate, config.mlp_bias, config.hidden_act)
        self.tp = plan.tp

    def forward(self, x, residual, positions, rotary, layer_cache, meta, backend):
        """x: the previous layer's output, residual: the stream before it (None at the first
        layer); returns this layer's (output, residual), the adds fused into the norms."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, layer_cache, meta, backend)
        if self.sandwich:  # Gemma 2/3: attention's output normalised before the add, the MLP's too
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.tp.all_reduce(self.mlp(x))), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.tp.all_reduce(self.mlp(x)), residual


class DecoderForCausalLM(nn.Module):
    """With `tp` (tensor parallelism), this rank's shard (model/parallel.py); `kv_config` is the
    shape of what this rank caches and attends over (its heads)."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config, self.tp = config, tp
        self.plan = ShardPlan.check(tp, config.num_heads, config.num_kv_heads, config.head_dim,
                                    config.intermediate_size, config.vocab_size)
        self.kv_config = replace(config, num_heads=self.plan.local_heads, num_kv_heads=self.plan.local_kv_heads)
        if tp.enabled:
            self.embed_tokens = VocabParallelEmbedding(self.plan.vocab_shard, config.hidden_size, self.plan.vocab_start, tp)
        else:
            # (no random init: it is overwritten, and meta's normal_ imports torch._dynamo, ~1.5 s of a start)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=torch.empty(config.vocab_size, config.hidden_size))
        windows = config.sliding_windows or (None,) * config.num_layers
        sparse = config.moe.sparse_layers if config.moe else (False,) * config.num_layers
        if config.moe and tp.enabled:
            raise ParamError("tensor_parallel_size", f"{config.architecture}: tensor parallelism does not shard "
                             "mixture-of-experts layers yet; run it with tensor_parallel_size=1")
        self.layers = nn.ModuleList(DecoderLayer(config, windows[i], self.plan, sparse[i])
                                    for i in range(config.num_layers))
        self.norm = make_norm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)
        with torch.device("cpu"):  # computed tables: on "meta" their ops would import torch._dynamo (~1.5 s)
            self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
            self.local_rotary = RotaryEmbedding(config.local_rope, config.head_dim, max_positions) \
                if config.local_rope else None
        vocab_rows = self.plan.vocab_shard if tp.enabled else config.vocab_size
        head = make_head(config)
        self.head_name = head[0] if head else None
        if head:  # every rank holds the whole head: its input, the final hidden states, is whole
            setattr(self, *head)
        no_lm_head = config.tie_word_embeddings or head is not None
        self.lm_head = None if no_lm_head else nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.backend = TorchSDPABackend()
        # the residual streams entering these layers, concatenated, kept after each forward as
        # `aux_hidden` (an EAGLE-3 head's features; engine/spec_decode/eagle.py)
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of T tokens -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        if self.config.embed_scale is not None:
            x = x * self._embed_scale(x.dtype)
        aux = {} if self.aux_layers else None
        for index, (layer, layer_cache) in enumerate(zip(self.layers, kv_caches)):
            if aux is not None and index in self.aux_layers:
                aux[index] = x.clone() if residual is None else x + residual  # (the norms add into residual in place)
            local = self.local_rotary is not None and layer.self_attn.window is not None
            rotary = self.local_rotary if local else self.rotary
            x, residual = layer(x, residual, positions, rotary, layer_cache, meta, self.backend)
        if aux is not None:
            self.aux_hidden = torch.cat([aux[index] for index in self.aux_layers], dim=-1)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """Gemma's embedding scale rounded to the weights' dtype first, as HF does (once per dtype)."""
        scales = self.__dict__.setdefault("_embed_scales", {})
        if dtype not in scales:
            scales[dtype] = torch.tensor(self.config.embed_scale, dtype=dtype).item()
        return scales[dtype]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (with tensor parallelism, every rank's part gathered), or a reward
        model's head outputs ([T, num_labels] or [T, 1])."""
        if self.head_name is not None:
            return getattr(self, self.head_name)(hidden).float()
        if self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp.enabled:
            logits = self.tp.all_gather_last(logits)[..., :self.config.vocab_size]
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            return torch.tanh(logits.float() / cap) * cap
        return logits.float()
