"""`--quantization int8`'s LM head: the logits' matrix as an `Int8Linear` (one scale per vocabulary
row), and, where the head is the embedding matrix (tied word embeddings), the embedding's lookups
served from the same int8 rows, so that the matrix is held once, a byte a weight.

At one row a step reads every weight once: Llama-3.2-1B's tied 128256 x 2048 head is 0.53 of its
2.47 GB in bfloat16, so with the head kept in bfloat16 int8 could not read fewer than 1.50 GB a
step (at most 1.65x bfloat16's rate), with it in int8 1.24 GB (2.0x). A reward model's head (its
`score` / `v_head`) is not a vocabulary and stays as stored; with tensor parallelism each rank
quantizes its own vocabulary rows (a row's scale is its own: the ranks' rows are one rank's), and a
vocabulary-parallel embedding keeps rows of its own, set to the dequantized ones (so that its lookups
are one rank's).
"""
from __future__ import annotations

import torch
from torch import nn

from treeserve.model import linear_kernels
from treeserve.model.packed_linear import checked_token_ids
from treeserve.model.quantization.int8 import SLICE_WEIGHTS, Int8Linear


def quantize_lm_head(model: nn.Module, method: str | None) -> bool:
    """With `method` "int8", the model's LM head (its `lm_head`, or the embedding matrix it ties to)
    replaced by an `Int8Linear` (`install_head`). Returns whether it quantized."""
    if method != "int8" or getattr(model, "head_name", None) is not None:
        return False
    if type(model.lm_head) is nn.Linear:
        install_head(model, Int8Linear(model.lm_head), model.lm_head.weight.dtype)
        return True
    if model.lm_head is not None:
        return False
    weight = model.embed_tokens.weight
    install_head(model, Int8Linear.of_weight(weight), weight.dtype)
    return True


def install_head(model: nn.Module, head: Int8Linear, dtype: torch.dtype) -> None:
    """`head` as the model's LM head; where it ties to the embedding, an `nn.Embedding` becomes the
    head's `Int8Embedding`, and a vocabulary-parallel one keeps rows of its own, set to the head's
    dequantized rows (so that its lookups are one rank's)."""
    tied = model.lm_head is None
    model.lm_head = head
    if not tied:
        return
    if type(model.embed_tokens) is nn.Embedding:
        model.embed_tokens = Int8Embedding(head, dtype)
    else:
        _dequantize_into(head, model.embed_tokens.weight)


@torch.no_grad()
def _dequantize_into(head: Int8Linear, weight: torch.Tensor) -> None:
    """`weight` [out, in] = the head's scale x int8 rows, computed in float32, SLICE_WEIGHTS at a time."""
    rows = linear_kernels.int8_unpack16(head.weight, head.out_features, head.in_features) if head.packed \
        else head.weight
    step = max(1, SLICE_WEIGHTS // head.in_features)
    for start in range(0, head.out_features, step):
        part = slice(start, start + step)
        weight[part] = rows[part].float() * head.scales[part, None]


class Int8Embedding(nn.Module):
    """Token embeddings read from a tied `Int8Linear` head (the same parameters: held and counted
    once): a token's row is its channel, scale x int8 computed in float32 and rounded to `dtype`
    (HF's embedding of the dequantized matrix, exactly). In the packed layout a row is the words of
    its block, one every 64 (a lookup's gather, negligible beside the step's products)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.quantized, self.scales, self.packed = head.weight, head.scales, head.packed
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = checked_token_ids(input_ids, self.num_embeddings)
        if self.packed:
            rows = linear_kernels.gather_channels(self.quantized, ids, self.embedding_dim,
                                                  linear_kernels.INT8_PACK16_BLOCK, torch.int16)
        else:
            rows = self.quantized[ids]
        out = (rows.float() * self.scales[ids, None]).to(self.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows of the lm_head"
