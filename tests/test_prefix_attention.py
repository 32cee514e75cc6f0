"""A prefill chunk's attention over its cached prefix (model/prefix_attention.py) against the
softmax over all its keys written out, and through the backend against a masked SDPA call."""
import pytest
import torch

from treeserve.model import prefix_attention
from treeserve.model.attention import AttentionMetadata, PrefillChunk, TorchSDPABackend


def _reference(query, keys, values, prefix_len, scale):
    """query [Q, Hq, D], keys/values [L, Hkv, D] (prefix then chunk): causal softmax in float64."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, Q, L]
    rows = torch.arange(query.shape[0])[:, None] + prefix_len
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > rows, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("segment", [None, 7, 64])
def test_chunk_over_prefix_matches_the_softmax_over_all_keys(dtype, tolerance, heads, kv_heads, segment):
    torch.manual_seed(0)
    prefix_len, query_len, dim = 150, 33, 32
    keys = torch.randn(prefix_len + query_len, kv_heads, dim).to(dtype)
    values = torch.randn(prefix_len + query_len, kv_heads, dim).to(dtype)
    query = torch.randn(query_len, heads, dim).to(dtype)
    reads = []

    def gather(start, end):
        reads.append((start, end))
        return keys[start:end].transpose(0, 1), values[start:end].transpose(0, 1)

    out = prefix_attention.chunk_over_prefix(query, keys[prefix_len:], values[prefix_len:], prefix_len, gather,
                                             0.2, segment)
    expected = _reference(query, keys, values, prefix_len, 0.2)
    assert out.dtype == dtype and out.shape == query.shape
    assert float((out.double() - expected).abs().max()) < tolerance
    step = segment or prefix_attention.PREFIX_SEGMENT_TOKENS
    assert reads == [(s, min(s + step, prefix_len)) for s in range(0, prefix_len, step)]  # each key read once


@pytest.mark.parametrize("block_size,segment", [(16, 40), (8, 4096)])
def test_backend_prefill_over_a_cached_prefix_matches_masked_sdpa(monkeypatch, block_size, segment):
    """The backend's chunk over a prefix in the paged cache (blocks out of order, a segment that
    does not divide into blocks) equals its masked SDPA path (the one sliding windows take)."""
    monkeypatch.setattr(prefix_attention, "PREFIX_SEGMENT_TOKENS", segment)
    torch.manual_seed(1)
    heads, kv_heads, dim, prefix_len, query_len = 8, 2, 16, 100, 37
    context = prefix_len + query_len
    num_blocks = -(-context // block_size)
    block_ids = torch.randperm(num_blocks + 3)[:num_blocks]
    cache = torch.zeros(num_blocks + 3, 2, block_size, kv_heads, dim)
    keys, values = torch.randn(context, kv_heads, dim), torch.randn(context, kv_heads, dim)
    positions = torch.arange(context)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    cache[block_ids[positions // block_size], 0, positions % block_size] = keys
    cache[block_ids[positions // block_size], 1, positions % block_size] = values
    q = torch.randn(query_len, heads, dim)
    chunk = PrefillChunk(slice(0, query_len), context, query_len, block_ids)
    meta = AttentionMetadata(slots[prefix_len:], block_size, prefills=[chunk])
    backend = TorchSDPABackend()
    split = backend._prefill(cache, q, keys[prefix_len:], values[prefix_len:], meta, 0, 0.25, None, True, None)
    monkeypatch.setattr(prefix_attention, "supported", lambda *args: False)
    masked = backend._prefill(cache, q, keys[prefix_len:], values[prefix_len:], meta, 0, 0.25, None, True, None)
    assert float((split - masked).abs().max()) < 1e-5
    assert float((split.double() - _reference(q, keys, values, prefix_len, 0.25)).abs().max()) < 1e-5
