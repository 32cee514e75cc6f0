"""The bfloat16 prefill kernel (csrc/flash_prefill.c: the CPU's bf16 dot products) against a float64
softmax reference over the same keys: chunks over a cached prefix and fresh prompts, GQA groups 1
to 8, head sizes 32 to 128, blocks of 16 and 15 tokens laid out in random order in the pages, a
one-token chunk, a chunk reaching past 64 keys in a tile; and an engine's greedy tokens with the
kernel equal to the same engine without it (bfloat16, a prompt long enough for chunked prefill)."""
import math

import pytest
import torch

from treeserve.model import cpu_kernels

LIBRARY = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIBRARY is None or LIBRARY.ts_flash_prefill_supported(64) != 1,
                                reason="hardware: no AVX512-BF16 here (or no C compiler): PyTorch's flash "
                                       "attention runs bf16 prefills instead")
# bfloat16 inputs, float32 sums: the output rounds to bf16 (2^-8 relative) and so do the
# probabilities before their product with the values (as PyTorch's bf16 kernel rounds them)
TOLERANCE = dict(atol=2e-2, rtol=2e-2)


def _paged(context_len, num_kv_heads, head_dim, block_size, generator):
    blocks = -(-context_len // block_size)
    pages = torch.randn(blocks + 6, 2, block_size, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    block_ids = torch.randperm(blocks + 6, generator=generator)[:blocks].to(torch.long)
    return pages, block_ids


def _reference(q, pages, block_ids, context_len, scale):
    _, num_heads, head_dim = q.shape
    keys = pages[block_ids, 0].reshape(-1, pages.shape[3], head_dim)[:context_len].double()
    values = pages[block_ids, 1].reshape(-1, pages.shape[3], head_dim)[:context_len].double()
    group = num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    positions = torch.arange(context_len - q.shape[0], context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize("context_len,query_len", [(50, 50), (300, 77), (129, 1), (200, 130), (1000, 1000)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_chunks_over_a_cached_prefix_match_the_reference(context_len, query_len, num_heads, num_kv_heads):
    generator = torch.Generator().manual_seed(context_len + num_heads)
    pages, block_ids = _paged(context_len, num_kv_heads, 64, 16, generator)
    q = torch.randn(query_len, num_heads, 64, generator=generator).to(torch.bfloat16)
    out = cpu_kernels.flash_prefill(LIBRARY, q, pages, block_ids, context_len, 0.125)
    torch.testing.assert_close(out.double(), _reference(q, pages, block_ids, context_len, 0.125), **TOLERANCE)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("block_size", [16, 15])
def test_head_sizes_and_blocks_that_do_not_divide_the_tiles(head_dim, block_size):
    generator = torch.Generator().manual_seed(head_dim + block_size)
    pages, block_ids = _paged(150, 2, head_dim, block_size, generator)
    q = torch.randn(40, 6, head_dim, generator=generator).to(torch.bfloat16)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full((40, 6, head_dim), float("nan"), dtype=torch.bfloat16)
    assert cpu_kernels.flash_prefill(LIBRARY, q, pages, block_ids, 150, scale, out) is out
    torch.testing.assert_close(out.double(), _reference(q, pages, block_ids, 150, scale), **TOLERANCE)


def test_a_strided_query_view_and_what_the_kernel_declines():
    """q as the attention layer passes it (a view into the qkv projection); float32, a head size
    that is not a multiple of 16 and more than 64 query heads a KV head are declined (None)."""
    generator = torch.Generator().manual_seed(5)
    pages, block_ids = _paged(90, 2, 64, 16, generator)
    qkv = torch.randn(30, (8 + 4) * 64, generator=generator).to(torch.bfloat16)
    q = qkv[:, :8 * 64].view(30, 8, 64)
    out = cpu_kernels.flash_prefill(LIBRARY, q, pages, block_ids, 90, 0.125)
    torch.testing.assert_close(out.double(), _reference(q, pages, block_ids, 90, 0.125), **TOLERANCE)
    assert cpu_kernels.flash_prefill(LIBRARY, q.float(), pages.float(), block_ids, 90, 0.125) is None
    odd_pages, _ = _paged(90, 2, 40, 16, generator)
    assert cpu_kernels.flash_prefill(LIBRARY, q[..., :40].contiguous(), odd_pages, block_ids, 90, 0.125) is None


def test_engine_tokens_with_the_kernel_equal_those_without(tmp_path, monkeypatch):
    """Greedy bfloat16 generation over a prompt prefilled in chunks (and one sharing its prefix):
    the same tokens with the kernel as with PyTorch's flash attention."""
    from treeserve import LLM, SamplingParams
    from treeserve.model.attention import TorchSDPABackend
    from treeserve.testing.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama", seed=3, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2)
    prompts = [list(range(5, 300)), list(range(5, 200)) + list(range(400, 480))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens():
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64,
                  max_model_len=512)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
    calls = []
    original = TorchSDPABackend._flash_prefill
    monkeypatch.setattr(TorchSDPABackend, "_flash_prefill",
                        staticmethod(lambda *a: calls.append(original(*a)) or calls[-1]))
    with_kernel = tokens()
    assert any(calls)  # the kernel ran chunks
    monkeypatch.setattr(TorchSDPABackend, "_flash_prefill", staticmethod(lambda *a: False))
    assert with_kernel == tokens()


def test_bf16_prefills_all_take_this_kernel_where_it_runs():
    """Where the kernel runs, no bf16 prefill row goes to the paged kernel (it is faster at every
    length); the old rule holds elsewhere (a head size it does not take)."""
    from treeserve.model.attention import PAGED_PREFILL_MAX_CONTEXT, paged_prefill_max_context
    assert paged_prefill_max_context(torch.bfloat16, 12, 4, 64) == 0
    assert paged_prefill_max_context(torch.bfloat16, 12, 4, 40) == PAGED_PREFILL_MAX_CONTEXT
