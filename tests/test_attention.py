"""Decode attention on CPU: the matmul kernel used outside float32 against PyTorch's SDPA."""
import torch
from torch.nn import functional as F

from treeserve.model import attention
from treeserve.model.attention import AttentionMetadata, DecodeGroup, TorchSDPABackend, decode_by_matmul

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 6, 8, 32


def _decode_step(generator):
    """Three sequences of 5, 9 and 12 tokens, their blocks scattered in the cache."""
    lens = torch.tensor([5, 9, 12])
    tables = torch.randperm(NUM_BLOCKS, generator=generator)[:9].view(3, 3)
    slots = tables[torch.arange(3), (lens - 1) // BLOCK_SIZE] * BLOCK_SIZE + (lens - 1) % BLOCK_SIZE
    group = DecodeGroup(slice(0, 3), tables, lens)
    return AttentionMetadata(slot_mapping=slots, block_size=BLOCK_SIZE, decode_groups=[group])


def _inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=generator)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM, generator=generator), torch.randn(3, KV_HEADS, HEAD_DIM, generator=generator)
    meta = _decode_step(generator)
    return [t.to(dtype) for t in (cache, q, k, v)] + [meta]


def test_matmul_decode_matches_sdpa_with_grouped_heads_and_padding():
    cache, q, _, _, meta = _inputs(torch.float32)
    group = meta.decode_groups[0]
    keys = TorchSDPABackend._gather(cache[:, 0], group.block_tables)
    values = TorchSDPABackend._gather(cache[:, 1], group.block_tables)
    mask = meta.decode_mask(0, None, torch.float32)
    expected = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=0.3,
                                              enable_gqa=True).squeeze(2)
    got = decode_by_matmul(q, keys, values, mask, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    # keys past a sequence's length change nothing: they are masked
    keys[0, :, 5:] = 100.0
    torch.testing.assert_close(decode_by_matmul(q, keys, values, mask, 0.3)[0], expected[0], atol=1e-6, rtol=1e-5)


def test_bfloat16_decode_on_cpu_uses_matmul_and_agrees_with_float32(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "decode_by_matmul",
                        lambda *args: calls.append(args[0].dtype) or decode_by_matmul(*args))
    backend = TorchSDPABackend()
    *tensors, meta = _inputs(torch.float32)
    reference = backend.forward(tensors[0].clone(), *tensors[1:], meta, HEAD_DIM ** -0.5, None)
    *halves, meta = _inputs(torch.bfloat16)
    got = backend.forward(halves[0], *halves[1:], meta, HEAD_DIM ** -0.5, None)
    assert got.dtype == torch.bfloat16
    assert calls == [torch.bfloat16]  # float32 went through SDPA
    torch.testing.assert_close(got.float(), reference, atol=3e-2, rtol=3e-2)
