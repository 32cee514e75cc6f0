"""treeserve's Triton kernels against a plain PyTorch reference: paged attention over mixed flat
batches (decode rows, fresh prefills, chunks over a cached prefix), GQA 1/2/4/8, cache blocks of
16, 32 and 15 tokens, head sizes 64, 80 and 96, sliding windows, soft-capped scores, split-KV decode, and the K/V write
by slot. Without CUDA they run under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""
import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from treeserve.model.kernels import kv_write, paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 only on a device: Triton's interpreter has no bfloat16
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# against a float32 reference of the same inputs: the kernel rounds its output (and its
# probabilities before the product with V) to the cache's type; bfloat16 keeps 8 significant bits
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator):
    """[num_blocks, 2, block_size, Hkv, D] views into byte-sized pages with room to spare, as the
    KV arena lays them out (a block's stride is its page, not its size)."""
    block_elems = 2 * block_size * num_kv_heads * head_dim
    pages = torch.randn(num_blocks, block_elems + 24, generator=generator).to(dtype)
    cache = pages[:, :block_elems].view(num_blocks, 2, block_size, num_kv_heads, head_dim)
    return cache.to(DEVICE)


def reference_attention(q, cache, query_lens, seq_lens, tables, scale, window, softcap=None):
    """Plain attention for each sequence's rows over the first seq_len keys its blocks hold."""
    block_size = cache.shape[2]
    out, start = torch.empty_like(q, dtype=torch.float32), 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, tables):
        slots = torch.arange(seq_len)
        blocks = torch.tensor(table)[slots // block_size]
        keys = cache[blocks, 0, slots % block_size].float()      # [L, Hkv, D]
        values = cache[blocks, 1, slots % block_size].float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        query = q[start:start + query_len].float()              # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        visible = slots[None, :] <= query_pos
        if window is not None:
            visible &= slots[None, :] > query_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + query_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += query_len
    return out


def batch_inputs(query_lens, seq_lens, block_size, num_blocks, generator):
    """Distinct random blocks for each sequence, padded block tables and query start offsets."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(order[:count])
        order = order[count:]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return tables, padded, starts


def check_unified(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window=None,
                  seed=0, softcap=None):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    tables, padded, starts = batch_inputs(query_lens, seq_lens, block_size, num_blocks, generator)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    paged_attention.unified_attention(q, cache[:, 0], cache[:, 1], out, starts.to(DEVICE),
                                      torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), padded.to(DEVICE),
                                      scale, window, softcap=softcap)
    ref = reference_attention(q.cpu(), cache.cpu(), query_lens, seq_lens, tables, scale, window, softcap)
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


MIXED = ([1, 1, 1, 7, 33, 20], [1, 18, 45, 7, 50, 61])  # decodes (one at its first token), a fresh
# prefill, and chunks over cached prefixes of 17 and 41 tokens


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_unified_attention_grouped_query_heads(group):
    check_unified(*MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)


@pytest.mark.parametrize("block_size", [16, 32, 15])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unified_attention_block_sizes_and_dtypes(block_size, dtype):
    check_unified(*MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype, seed=1)


@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_unified_attention_head_sizes_padded_inside_the_kernel(head_dim):
    check_unified([1, 3, 19], [29, 3, 40], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
                  dtype=torch.float32, seed=2)


def test_unified_attention_long_chunk_over_a_cached_prefix():
    check_unified([70], [130], num_heads=4, num_kv_heads=1, head_dim=32, block_size=16, dtype=torch.float32, seed=3)


@pytest.mark.parametrize("window", [1, 5, 24])
def test_unified_attention_sliding_window(window):
    check_unified(*MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
                  window=window, seed=4)


@pytest.mark.parametrize("window,softcap", [(None, 0.5), (5, 0.5)])
def test_unified_attention_soft_capped_scores(window, softcap):
    """Gemma 2's soft cap: scores (random q/k, head 32, about +-3 after scaling) squeezed into +-0.5."""
    check_unified(*MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
                  window=window, seed=7, softcap=softcap)


@pytest.mark.parametrize("num_splits,window,softcap", [(1, None, None), (4, None, None), (8, None, None),
                                                       (4, 9, None), (4, None, 0.5)])
@pytest.mark.parametrize("group", [1, 4])
def test_split_kv_decode_matches_the_reference(num_splits, window, softcap, group):
    generator = torch.Generator().manual_seed(5)
    seq_lens, block_size, head_dim = [1, 37, 150, 64], 16, 80
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    cache = make_cache(num_blocks, block_size, 2, head_dim, torch.float32, generator)
    tables, padded, _ = batch_inputs([1] * len(seq_lens), seq_lens, block_size, num_blocks, generator)
    q = torch.randn(len(seq_lens), 2 * group, head_dim, generator=generator).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    buffers = paged_attention.split_kv_buffers(len(seq_lens), 2 * group, head_dim, num_splits, torch.device(DEVICE))
    paged_attention.split_kv_decode(q, cache[:, 0], cache[:, 1], out, torch.tensor(seq_lens, dtype=torch.int32,
                                    device=DEVICE), padded.to(DEVICE), 0.1, window, buffers, softcap)
    ref = reference_attention(q.cpu(), cache.cpu(), [1] * len(seq_lens), seq_lens, tables, 0.1, window, softcap)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_a_padded_row_of_length_zero_attends_to_nothing():
    """A CUDA graph's padded rows: sequence length 0 gives zeros (no NaN) in both kernels."""
    generator = torch.Generator().manual_seed(6)
    cache = make_cache(4, 16, 2, 32, torch.float32, generator)
    q = torch.randn(2, 4, 32, generator=generator).to(DEVICE)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[1], [0]], dtype=torch.int32, device=DEVICE)
    unified, split = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    paged_attention.unified_attention(q, cache[:, 0], cache[:, 1], unified,
                                      torch.arange(3, dtype=torch.int32, device=DEVICE), seq_lens, tables, 0.2, None)
    buffers = paged_attention.split_kv_buffers(2, 4, 32, 4, torch.device(DEVICE))
    paged_attention.split_kv_decode(q, cache[:, 0], cache[:, 1], split, seq_lens, tables, 0.2, None, buffers)
    ref = reference_attention(q[:1].cpu(), cache.cpu(), [1], [5], [[1]], 0.2, None)
    for out in (unified, split):
        torch.testing.assert_close(out[:1].cpu(), ref)
        assert torch.equal(out[1].cpu(), torch.zeros(4, 32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_by_slot_skips_negative_slots(dtype):
    generator = torch.Generator().manual_seed(7)
    cache = make_cache(5, 16, 3, 80, dtype, generator)
    before = cache.clone()
    k = torch.randn(4, 3, 80, generator=generator).to(dtype).to(DEVICE)
    v = torch.randn(4, 3, 80, generator=generator).to(dtype).to(DEVICE)
    slots = torch.tensor([3, 16 * 4 + 15, -1, 16 * 2], device=DEVICE)
    kv_write.write_kv(k, v, cache[:, 0], cache[:, 1], slots)
    expected = before.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 16, 0, slot % 16] = k[row]
            expected[slot // 16, 1, slot % 16] = v[row]
    assert torch.equal(cache.cpu(), expected.cpu())
