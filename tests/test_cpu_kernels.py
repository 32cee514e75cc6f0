"""treeserve's C kernels against PyTorch: paged attention against a per-sequence softmax reference,
the elementwise layers bit for bit in bfloat16 against the PyTorch ops they replace, and the
engine falling back to PyTorch (same tokens) where the kernels cannot be built."""
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from treeserve.model import cpu_kernels
from treeserve.model.attention import (AttentionMetadata, PagedRows, PrefillChunk, TorchSDPABackend,
                                       paged_prefill_max_context)
from treeserve.model.layers import GatedMLP, RMSNorm, _rotate_half

LIBRARY = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="treeserve's CPU kernels could not be built here (no cc?)")

BLOCK, KV_HEADS, HEADS, HEAD_DIM, BLOCKS = 4, 2, 6, 16, 64


def _reference(q, cache, tables, lens, scale, window=None, softcap=None):
    """Per row: softmax over the row's first `len` keys (the last `window` of them), scores
    soft-capped if `softcap`, float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    head_dim = q.shape[-1]
    for i, (table, length) in enumerate(zip(tables, lens)):
        keys = cache[table, 0].reshape(-1, KV_HEADS, head_dim)[:length].double()
        values = cache[table, 1].reshape(-1, KV_HEADS, head_dim)[:length].double()
        first = 0 if window is None else max(0, length - window)
        keys, values = keys[first:].repeat_interleave(3, 1), values[first:].repeat_interleave(3, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double() * scale, keys)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", probs, values)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 1.5), (5, 1.5)])  # 1.5: Gemma 2's cap, tight
@pytest.mark.parametrize("block", [BLOCK, 5])  # 5: the kernel's 16-key tiles start mid-block
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])  # 64: bfloat16 tiles through vdpbf16ps where the CPU has it
def test_paged_rows_match_reference_for_decode_and_prefill_rows(dtype, tol, window, softcap, block, head_dim):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(BLOCKS, 2, block, KV_HEADS, head_dim, generator=gen).to(dtype)
    rows = PagedRows()
    tables, lens = [], []
    for length in (1, 3, 4, 9, 17, 30, 71):  # decode rows: one block, a partial block, many blocks
        table = torch.randperm(BLOCKS, generator=gen)[: -(-length // block)].tolist()
        rows.add_decode(length, table)
        tables.append(table), lens.append(length)
    table = torch.randperm(BLOCKS, generator=gen)[:4].tolist()
    rows.add_prefill(14, 6, table)  # a prefill chunk after a cached prefix: rows of 9..14 keys
    tables += [table] * 6
    lens += list(range(9, 15))
    # a whole prefill of 45 tokens right after it: rows attended in units of consecutive tokens
    # (the kernel's QUERY_BLOCK), which must not run into the chunk before
    table = torch.randperm(BLOCKS, generator=gen)[: -(-45 // block)].tolist()
    rows.add_prefill(45, 45, table)
    tables += [table] * 45
    lens += list(range(1, 46))
    q = torch.randn(len(lens), HEADS, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    cpu_kernels.paged_attention(LIBRARY, q, cache, *rows.tensors, 0.25, window, out, softcap)
    expected = _reference(q, cache, tables, lens, 0.25, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif("avx512_bf16" not in Path("/proc/cpuinfo").read_text(),
                    reason="hardware: no AVX512-BF16 on this CPU (the paged kernel widens bfloat16 to float32 there)")
def test_bfloat16_tiles_run_vdpbf16ps_where_the_cpu_has_it():
    assert LIBRARY.ts_paged_bf16_tiles(64) == 1 and LIBRARY.ts_paged_bf16_tiles(128) == 1
    assert LIBRARY.ts_paged_bf16_tiles(HEAD_DIM) == 0  # 16: the float32 tiles


def _grouped_reference(q, cache, tables, lens, scale, window=None):
    """`_reference` for any number of KV heads and query heads per KV head."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (table, length) in enumerate(zip(tables, lens)):
        first = 0 if window is None else max(0, length - window)
        keys, values = (cache[table, part].reshape(-1, kv_heads, head_dim)[first:length].double()
                        .repeat_interleave(group, 1) for part in (0, 1))
        probs = torch.einsum("hd,lhd->hl", q[i].double() * scale, keys).softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", probs, values)
    return out


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8, 12])  # 12: past the two-pass path's 8, the tiles
@pytest.mark.parametrize("head_dim,window", [(64, None), (128, None), (96, 600)])
def test_bfloat16_decode_rows_match_reference_across_segments(group, head_dim, window):
    """Decode rows of 1 to 1,300 keys: the two-pass path scores 512 keys a segment and merges the
    segments by their maxima (a wrong merge moves the long rows' outputs by far more than 2e-2)."""
    gen = torch.Generator().manual_seed(group)
    kv_heads, block, lengths = 2, 16, (1, 15, 512, 513, 1300)
    cache = torch.randn(-(-sum(lengths) // block) + len(lengths), 2, block, kv_heads, head_dim,
                        generator=gen).to(torch.bfloat16)
    order = torch.randperm(cache.shape[0], generator=gen).tolist()
    rows, tables = PagedRows(), []
    for length in lengths:
        table, order = order[: -(-length // block)], order[-(-length // block):]
        rows.add_decode(length, table)
        tables.append(table)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    cpu_kernels.paged_attention(LIBRARY, q, cache, *rows.tensors, 0.1, window, out)
    expected = _grouped_reference(q, cache, tables, lengths, 0.1, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif("avx512_bf16" not in Path("/proc/cpuinfo").read_text(),
                    reason="hardware: no AVX512-BF16 on this CPU (decode rows take the tiles there)")
def test_bfloat16_decode_rows_take_the_two_pass_path_where_the_cpu_has_it():
    assert LIBRARY.ts_paged_decode_rows(3, 64) == 1 and LIBRARY.ts_paged_decode_rows(8, 128) == 1
    assert LIBRARY.ts_paged_decode_rows(12, 64) == 0 and LIBRARY.ts_paged_decode_rows(4, 80) == 0


def test_backend_paged_rows_agree_with_the_gathering_path():
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(BLOCKS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    lens = [5, 9, 12]
    tables = [torch.randperm(BLOCKS, generator=gen)[: -(-n // BLOCK)].tolist() for n in lens]
    paged = PagedRows()
    for table, length in zip(tables, lens):
        paged.add_decode(length, table)
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)])
    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
    backend = TorchSDPABackend()
    kernel = backend.forward(cache.clone(), q, k, v, AttentionMetadata(slots, BLOCK, paged=paged), 0.3, None)
    gathered = AttentionMetadata(slots, BLOCK, decode_groups=paged.groups(BLOCK))
    torch.testing.assert_close(kernel, backend.forward(cache.clone(), q, k, v, gathered, 0.3, None),
                               atol=1e-5, rtol=1e-5)


def test_backend_prefill_rows_agree_with_sdpa_after_a_cached_prefix():
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(BLOCKS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(BLOCKS, generator=gen)[:4].tolist()  # 16 slots; 9 cached, 5 new tokens
    first, count = 9, 5
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + count)])
    q = torch.randn(count, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(count, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(count, KV_HEADS, HEAD_DIM, generator=gen)
    chunk = PrefillChunk(slice(0, count), first + count, count, torch.tensor(table))
    paged = PagedRows()
    paged.add_prefill(first + count, count, table)
    backend = TorchSDPABackend()
    kernel = backend.forward(cache.clone(), q, k, v, AttentionMetadata(slots, BLOCK, prefills=[chunk], paged=paged),
                             0.3, None)
    sdpa = backend.forward(cache.clone(), q, k, v, AttentionMetadata(slots, BLOCK, prefills=[chunk]), 0.3, None)
    torch.testing.assert_close(kernel, sdpa, atol=1e-5, rtol=1e-5)


def test_prefill_rows_join_the_kernel_only_where_it_is_faster():
    assert paged_prefill_max_context(torch.bfloat16, 12, 4) > 0
    assert paged_prefill_max_context(torch.bfloat16, 4, 4) == 0   # no grouped-query attention
    assert paged_prefill_max_context(torch.float32, 12, 4) == 0   # MKL's float32 SDPA is the faster


def test_kernel_shapes_beyond_its_limits_are_refused():
    q = torch.zeros(1, 34, 16)
    cache = torch.zeros(4, 2, BLOCK, 2, 16)
    assert not cpu_kernels.supports(q.dtype, q.device, 34, 2, 16)  # 17 query heads per KV head
    with pytest.raises(ValueError, match="limits"):
        cpu_kernels.paged_attention(LIBRARY, q, cache, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                 torch.ones(1, dtype=torch.long), 1.0, None, torch.empty_like(q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [96, 1000])  # 1000: a partial vector of 16 lanes at the end
def test_rms_norm_with_and_without_residual(dtype, size):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(size, 1e-5).to(dtype)
    norm.weight.data = torch.randn(size, generator=gen).to(dtype)
    x, residual = torch.randn(2, 5, size, generator=gen).to(dtype), torch.randn(2, 5, size, generator=gen).to(dtype)
    exact = dtype == torch.bfloat16  # each rounding as PyTorch's ops; float32 sums in another order
    tol = {"atol": 0, "rtol": 0} if exact else {"atol": 1e-6, "rtol": 1e-5}
    with torch.no_grad():  # the kernel serves inference; with gradients wanted PyTorch's ops run
        fused, (out, summed) = norm(x), norm(x, residual.clone())
    torch.testing.assert_close(fused, norm._norm(x), **tol)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, norm._norm(x + residual), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 80])  # halves of 8 and 40: partial vectors of 16 lanes
def test_silu_mul_and_rotary_match_pytorch(dtype, head_dim):
    gen = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(7, 2 * 40, generator=gen)).to(dtype)  # gates far into both tails
    expected = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    tol = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(cpu_kernels.silu_mul(LIBRARY, gate_up), expected, **tol)

    positions = torch.tensor([0, 3, 17, 5, 90])
    cos, sin = torch.randn(100, head_dim, generator=gen), torch.randn(100, head_dim, generator=gen)
    qkv = torch.randn(5, 8 * head_dim, generator=gen).to(dtype)
    q, k, _ = (t.view(5, -1, head_dim) for t in qkv.split((4 * head_dim, 2 * head_dim, 2 * head_dim), dim=-1))
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    want_q, want_k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    cpu_kernels.rotary_(LIBRARY, q, k, positions, cos, sin)  # adjacent in qkv: one pass
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    apart_q, apart_k = want_q.clone(), want_k.clone()
    cpu_kernels.rotary_(LIBRARY, apart_q, apart_k, positions, cos, sin)  # separate tensors: two passes
    torch.testing.assert_close(apart_q, want_q * c + _rotate_half(want_q) * s, **tol)


def test_write_kv_matches_index_put():
    gen = torch.Generator().manual_seed(4)
    pages = torch.zeros(BLOCKS, 3, 2, BLOCK, KV_HEADS, HEAD_DIM)  # a layer's view is strided, as in the arena
    layer = pages[:, 1]
    kv = torch.randn(5, 2 * KV_HEADS * HEAD_DIM, generator=gen)
    k, v = (t.view(5, KV_HEADS, HEAD_DIM) for t in kv.split(KV_HEADS * HEAD_DIM, dim=-1))
    slots = torch.tensor([0, 7, 13, 200, 255])
    cpu_kernels.write_kv(LIBRARY, layer, k, v, slots)
    expected = torch.zeros_like(pages)
    expected[:, 1, 0].index_put_((slots // BLOCK, slots % BLOCK), k)
    expected[:, 1, 1].index_put_((slots // BLOCK, slots % BLOCK), v)
    assert torch.equal(pages, expected)


def test_gated_mlp_uses_the_kernel_only_outside_autograd():
    mlp = GatedMLP(8, 12, bias=False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        fast = mlp(x)
    slow = mlp(x)  # parameters need gradients: PyTorch's ops, so that backward works
    assert slow.requires_grad
    slow.sum().backward()
    torch.testing.assert_close(fast, slow.detach(), atol=1e-6, rtol=1e-5)


def test_engine_without_kernels_gives_the_same_tokens(llama_dir, monkeypatch):
    from treeserve.entrypoints.llm import LLM
    from treeserve.sampling_params import SamplingParams

    prompts = ["The capital of France is", "One two three", "a b c d e f g h i j k l m n o p"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def tokens():
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    with_kernels = tokens()
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert cpu_kernels.library_for(torch.zeros(1)) is None
    assert tokens() == with_kernels


def test_build_failure_falls_back_with_the_reason(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.delenv("CC")
        cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("march", ["x86-64-v3", "icelake-server"])
def test_the_kernels_build_for_other_x86_cpus(march, tmp_path):
    """`-march=native` builds only what this CPU has: each path must compile where its guard lets it
    in. AVX2 without AVX-512, and Ice Lake's AVX512-VNNI without AVX512-BF16 (the W8A8 kernel had
    used a bf16 instruction there, so no kernel at all was built on such a server)."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("hardware: no C compiler")
    flags = [f for f in cpu_kernels.FLAGS if not f.startswith(("-march", "-O"))] + [f"-march={march}", "-O1"]
    done = subprocess.run([compiler, *flags, *map(str, cpu_kernels.SOURCES), *cpu_kernels.LIBS,
                           "-o", str(tmp_path / "kernels.so")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
