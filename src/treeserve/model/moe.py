"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router (`gate`, Linear to the experts) gives each token a softmax over the experts; its top k
are taken (renormalised where the family does) as that token's weights. The experts' weights are
stacked, `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (the loader fills
them from the checkpoints' per-expert tensors), and computed grouped: the (token, expert) pairs
are sorted by expert, and each expert that some token chose runs one SwiGLU over its tokens
(no loop over tokens); the results, times their weights, are added back by token. On CUDA one
Triton launch does every expert's product (model/kernels/grouped_experts.py). Qwen2-MoE adds a
shared expert every token takes, scaled by a sigmoid gate. Rounding follows HF transformers: the
weights in float32 (Mixtral) or the model's dtype (Qwen), each expert's output cast back to the
model's dtype before the sum. In bfloat16 on a CPU without bfloat16 units (AVX2 only), each
product runs in float32 over the weight converted for the call (exact: the product of two
bfloat16 numbers fits a float32) and is rounded back where a bfloat16 product would be: bfloat16
matmuls there are several times slower than the conversion and a float32 one
(`benchmarks/moe_decode.py --dtype bfloat16`). On a CPU with bfloat16 units the experts' weights
are packed at load (`pack_experts`, as the dense layers: csrc/bf16_linear.c's layout where that
kernel runs, else oneDNN's), and a step gathers every pair's row once, runs each expert's rows
through its packed weights into one buffer, and sums each token's weighted outputs in expert order
(HF's order): a Mixtral-shaped decode at batch 64 on an AVX512-BF16 EPYC went 1,950 -> 2,500 tok/s
with oneDNN's layout, -> 3,630 with the C kernel (each expert's ~16 rows are where it leads most).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.hf_config import MoEConfig
from treeserve.model.kernels import fused_ops_for, grouped_experts_for
from treeserve.model.layers import GatedMLP
from treeserve.model.packed_linear import bf16_kernel, can_pack, computes_in_float32, float32_weight


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.packed: tuple[nn.ParameterList, nn.ParameterList] | None = None  # see `pack`
        self.in_kernel = False  # the packed weights in csrc/bf16_linear.c's layout (else oneDNN's)

    def pack(self) -> None:
        """Each expert's two weights packed (bfloat16 on a CPU with bfloat16 units, `can_pack`):
        in csrc/bf16_linear.c's layout where that kernel runs (`bf16_kernel`), else in oneDNN's; a
        decode step's few rows per expert then skip the reorder that an unpacked bfloat16 matmul
        does on every call. The stacked weights are dropped (the packed ones replace them, not
        double them)."""
        self.in_kernel = bf16_kernel() is not None
        pack = linear_kernels.bf16_pack if self.in_kernel else \
            (lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, None))

        def packed(stacked: torch.Tensor) -> nn.ParameterList:  # parameters: the memory accounting sees them
            return nn.ParameterList([nn.Parameter(pack(stacked[e].detach().contiguous()), requires_grad=False)
                                     for e in range(self.num_experts)])
        self.packed_gate_up, self.packed_down = packed(self.gate_up_proj), packed(self.down_proj)
        self.packed = (self.packed_gate_up, self.packed_down)
        self.gate_up_proj = nn.Parameter(torch.empty(0, dtype=self.gate_up_proj.dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0, dtype=self.down_proj.dtype), requires_grad=False)

    def _packed_forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The packed experts: each token's pairs taken in expert order (as HF's loop over experts
        adds them), every expert's rows in one gather, its outputs written in place, and the
        weighted outputs (rounded to x's dtype, as HF rounds each) summed per token in that order."""
        num_tokens, top_k = expert_ids.shape
        expert_ids, slot_order = expert_ids.sort(dim=1)
        weights = weights.gather(1, slot_order)
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert; pair i is (token order[i] // k, slot % k)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // top_k)
        outputs = torch.empty_like(rows)
        library = cpu_kernels.library_for(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                gate_up, down = self.packed[0][expert], self.packed[1][expert]
                h = self._product(rows[start:start + count], gate_up, 2 * self.intermediate)
                act = cpu_kernels.silu_mul(library, h) if library is not None else \
                    F.silu(h[:, :self.intermediate]) * h[:, self.intermediate:]
                outputs[start:start + count] = self._product(act, down, x.shape[1])
                start += count
        weighted = (outputs * weights.reshape(-1)[order, None]).to(x.dtype)
        by_slot = torch.empty_like(weighted).index_copy_(0, order, weighted).view(num_tokens, top_k, -1)
        out = by_slot[:, 0].clone()
        for slot in range(1, top_k):
            out += by_slot[:, slot]
        return out

    def _product(self, rows: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
        """rows [n, in] times one packed expert weight: [n, out_features]."""
        if self.in_kernel:
            return linear_kernels.bf16_linear(cpu_kernels.load(), rows, weight, None, out_features)
        return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> sum over k of weight * expert(x) [T, H]."""
        if (grouped := grouped_experts_for(x)) is not None:  # CUDA: every expert in one Triton launch
            return grouped.experts_forward(x.contiguous(), self.gate_up_proj, self.down_proj, expert_ids, weights,
                                           fused_ops_for(x).silu_mul)
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // top_k
        pair_weights = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        upcast = computes_in_float32(x)
        source = x.float() if upcast else x
        if self.packed is not None:
            return self._packed_forward(x, expert_ids, weights)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            # transposed (weight @ x^T): the few rows of a decode step are the small operand, which
            # BLAS then packs instead of the expert's weight (~25% less time on a 2-core AVX2 CPU)
            h = _mm(self.gate_up_proj[expert], source[rows].t(), x.dtype, upcast)
            y = _mm(self.down_proj[expert], F.silu(h[:self.intermediate]) * h[self.intermediate:], x.dtype, upcast).t()
            out.index_add_(0, rows, (y * pair_weights[start:start + count, None]).to(x.dtype))
            start += count
        return out


def pack_experts(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Packs every `StackedExperts` where oneDNN's layout is exact and faster (`can_pack`: bfloat16
    on a CPU with bfloat16 units); how many."""
    if not can_pack(dtype, device):
        return 0
    stacks = [m for m in model.modules() if isinstance(m, StackedExperts)]
    for stack in stacks:
        stack.pack()
    return len(stacks)


def _mm(weight: torch.Tensor, rhs: torch.Tensor, dtype: torch.dtype, upcast: bool) -> torch.Tensor:
    """weight @ rhs in `dtype`, computed in float32 where `upcast` (rounded once at the end)."""
    if not upcast:
        return torch.mm(weight, rhs)
    return torch.mm(float32_weight(weight), rhs.float()).to(dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int, bias: bool):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = StackedExperts(moe.num_experts, hidden, moe.intermediate_size)
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_expert_size, bias)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights if self.moe.weights_in_float32 else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(x)
        out = self.experts(x, expert_ids, weights)
        if self.moe.shared_expert_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
