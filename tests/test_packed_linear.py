"""bfloat16 linears on CPU: packed where the CPU has fast bf16 (treeserve's kernel, the float32
product rounded once, used by the engine; or oneDNN's layout, bit-identical to `F.linear`), float32
products where it has none (the same products in another summation order; the engine's logits
within bf16 rounding of plain bf16 matmuls, MoE experts included)."""
import copy
import weakref

import pytest
import torch
from torch import nn

from treeserve import LLM, SamplingParams
from treeserve.model import cpu_kernels, linear_kernels, packed_linear
from treeserve.config import cpu_has_fast_bf16
from treeserve.model.layers import GatedMLP
from treeserve.model.packed_linear import (Bf16Linear, Bf16RotaryLinear, Bf16SiluMulLinear, Float32Linear,
                                           PackedEmbedding, PackedLinear, bf16_kernel, can_pack, pack_linears)
from treeserve.model.random_models import make_tiny_model

CPU = torch.device("cpu")
PACKED = (Bf16Linear, PackedLinear)
needs_packing = pytest.mark.skipif(not can_pack(torch.bfloat16, CPU),
                                   reason="hardware: this CPU has no fast bfloat16 (AVX512-BF16 or AMX) or torch no oneDNN")
needs_kernel = pytest.mark.skipif(
    bf16_kernel() is None, reason="hardware: no AVX512-BF16 (or no C compiler): treeserve's bf16 linear cannot run")


def assert_rounded_once(out: torch.Tensor, exact: torch.Tensor) -> None:
    """`out` (bfloat16) is `exact` (float64) rounded to bfloat16 once, up to float32's summation
    order: no element more than one bfloat16 unit off, and nearly all of them equal."""
    expected = exact.to(torch.bfloat16)
    unit = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2.0 ** -7  # one bfloat16 unit at each value
    assert bool(((out.double() - expected.double()).abs() <= unit).all())
    assert int((out != expected).sum()) <= 0.01 * out.numel()


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("shape", [(160, 96), (70, 2304)], ids=["one-span", "three-spans-short-block"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_is_the_float32_product_rounded_once(rows, shape, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(shape[1], shape[0], bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        exact = nn.functional.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    layer = Bf16Linear(linear)
    assert torch.equal(layer.weight, linear.weight)
    assert_rounded_once(layer(x), exact)
    assert torch.equal(layer(x.t().contiguous().t()), layer(x))  # a strided input too
    assert torch.equal(layer(x.view(1, rows, shape[1])), layer(x).view(1, rows, shape[0]))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("k_in", [96, 2304], ids=["one-span", "three-spans"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gate_and_up_linear_ends_with_silu_mul_as_the_separate_ops(rows, k_in, bias):
    """`Bf16SiluMulLinear` (the activation in the kernel's epilogue) gives bit for bit what the plain
    packed product followed by PyTorch's silu(gate) * up gives, and its weight back in the
    gates-then-ups order."""
    torch.manual_seed(rows + k_in)
    linear = nn.Linear(k_in, 2 * 96, bias=bias).to(torch.bfloat16)
    x = (3 * torch.randn(rows, k_in)).to(torch.bfloat16)  # gates far into silu's tails
    fused, plain = Bf16SiluMulLinear(linear), Bf16Linear(linear)
    assert torch.equal(fused.weight, linear.weight)
    gate, up = plain(x).split(96, dim=-1)
    assert torch.equal(fused(x), nn.functional.silu(gate) * up)
    assert torch.equal(fused(x.view(1, rows, k_in)), fused(x).view(1, rows, 96))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("head_dim,k_in", [(64, 96), (128, 2304), (256, 64)], ids=["64", "128-three-spans", "256"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_qkv_linear_ends_with_rotary_as_the_separate_kernel(rows, head_dim, k_in, bias):
    """`Bf16RotaryLinear` (the rotation in the kernel's epilogue) gives bit for bit the plain packed
    product rotated by `cpu_kernels.rotary_` (itself PyTorch's rounding, test_cpu_kernels.py): 3 q heads
    and 1 k head rotated, v's 2 heads as they are; its weight back in its own order."""
    torch.manual_seed(rows + head_dim)
    rotary_channels = 4 * head_dim
    linear = nn.Linear(k_in, 6 * head_dim, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, k_in).to(torch.bfloat16)
    positions = torch.randint(0, 50, (rows,))
    cos, sin = 2 * torch.rand(50, head_dim) - 1, 2 * torch.rand(50, head_dim) - 1
    fused = Bf16RotaryLinear(linear, head_dim, rotary_channels)
    assert torch.equal(fused.weight, linear.weight)
    expected = Bf16Linear(linear)(x)
    q, k = expected[:, :3 * head_dim].view(rows, 3, head_dim), expected[:, 3 * head_dim:rotary_channels].view(rows, 1, head_dim)
    cpu_kernels.rotary_(cpu_kernels.load(), q, k, positions, cos, sin)
    assert torch.equal(fused(x, positions, cos, sin), expected)
    with pytest.raises(ValueError, match="int64 positions, one per row"):
        fused(x, positions[:0], cos, sin)


@needs_kernel
def test_a_bfloat16_engine_with_heads_of_64_rotates_in_the_qkv_kernel_and_decodes_as_apart(tmp_path, monkeypatch):
    """Heads of 64 (the tests' other tiny models have smaller ones): the engine's q, k and v linears
    rotate in their epilogue and its MLPs' gate and up apply SiLU there; its tokens and logprobs are
    those of the same engine with both apart, exactly."""
    path = make_tiny_model("llama", tmp_path / "heads64", seed=4, hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, intermediate_size=96)
    fused = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    attention, mlp = fused.engine.model.layers[0].self_attn, fused.engine.model.layers[0].mlp
    assert isinstance(attention.qkv_proj, Bf16RotaryLinear) and isinstance(mlp.gate_up_proj, Bf16SiluMulLinear)
    monkeypatch.setattr(packed_linear, "_with_epilogue", lambda parent, name, linear: None)
    apart = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    assert type(apart.engine.model.layers[0].self_attn.qkv_proj) is Bf16Linear
    _assert_same_decode(_decode(fused), _decode(apart), exact=True)
    normed = make_tiny_model("qwen3", tmp_path / "qk-norm", seed=4, hidden_size=128, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=64, intermediate_size=96)
    model = LLM(str(normed), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20).engine.model
    assert type(model.layers[0].self_attn.qkv_proj) is Bf16Linear  # q and k normed before the rotation


@needs_kernel
def test_only_a_swiglu_mlp_whose_size_the_kernel_takes_gets_the_fused_activation():
    def packed_kinds(intermediate, act):
        mlp = GatedMLP(64, intermediate, bias=False, act=act).to(torch.bfloat16)
        reference = copy.deepcopy(mlp)  # the activation apart, after the plain packed product
        reference.gate_up_proj, reference.down_proj = Bf16Linear(mlp.gate_up_proj), Bf16Linear(mlp.down_proj)
        assert pack_linears(mlp, torch.bfloat16, CPU) == 2
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(mlp(x), reference(x))
        return type(mlp.gate_up_proj), type(mlp.down_proj)

    assert packed_kinds(96, "silu") == (Bf16SiluMulLinear, Bf16Linear)
    assert packed_kinds(80, "silu") == (Bf16Linear, Bf16Linear)  # not a multiple of 32 channels
    assert packed_kinds(96, "gelu_pytorch_tanh") == (Bf16Linear, Bf16Linear)
    with pytest.raises(ValueError, match="not twice a multiple of 32"):
        Bf16SiluMulLinear(nn.Linear(64, 2 * 80, bias=False).to(torch.bfloat16))


@needs_kernel
def test_bf16_linear_keeps_nan_and_infinity_in_their_rows():
    linear = nn.Linear(64, 70, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    out = Bf16Linear(linear)(x)
    assert bool(out[0].isfinite().all()) and bool(out[1].isnan().all()) and not bool(out[2].isfinite().any())


@needs_packing
def test_a_cpu_with_amx_keeps_onednn_layout(monkeypatch):
    """AMX tiles run oneDNN's matmuls at several times the vector units' rate: no C kernel there."""
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: True)
    assert bf16_kernel() is None
    model = nn.Sequential(nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    assert pack_linears(model, torch.bfloat16, CPU) == 1 and isinstance(model[0], PackedLinear)


def test_bf16_pack_reads_back_and_refuses_what_it_cannot_take():
    weight = torch.randn(70, 96).to(torch.bfloat16)
    packed = linear_kernels.bf16_pack(weight)
    assert packed.numel() == 128 * 96
    assert torch.equal(linear_kernels.bf16_unpack(packed, 70, 96), weight)
    with pytest.raises(ValueError, match="K even"):
        linear_kernels.bf16_pack(torch.randn(4, 5).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        linear_kernels.bf16_pack(torch.randn(4, 6))


@needs_packing
def test_packing_frees_each_replaced_weight_as_it_goes(monkeypatch):
    """A load's peak: each float weight is dropped once its packed layer replaces it, not when every
    layer is packed (which held a second copy of every weight: a 1B model's load peaked 1.7 GiB higher)."""
    model = nn.Sequential(nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(3)])).to(torch.bfloat16)
    refs = [weakref.ref(linear) for linear in model[0]]
    alive, original = [], packed_linear._packed

    def counting(*args):
        alive.append(sum(ref() is not None for ref in refs))
        return original(*args)

    monkeypatch.setattr(packed_linear, "_packed", counting)
    assert pack_linears(model, torch.bfloat16, CPU) == 3
    assert alive == [3, 2, 1]


def test_packing_in_place_writes_the_same_layout_over_the_weight():
    """The tied LM head's packing (bfloat16) and int8's: the layout written over the weight's own
    bytes, chunk by chunk (chunks smaller than the weight here), is the one a new tensor gets."""
    bf16 = torch.randn(192, 96).to(torch.bfloat16)
    expected, storage = linear_kernels.bf16_pack(bf16), bf16.untyped_storage().data_ptr()
    monkey = linear_kernels.PACK_CHUNK_BYTES
    linear_kernels.PACK_CHUNK_BYTES = 64 * 96 * 2  # one block a chunk: the chunks' copies matter
    try:
        packed = linear_kernels.bf16_pack(bf16, in_place=True)
        int8 = torch.randint(-127, 128, (128, 64), dtype=torch.int8)
        int8_expected = linear_kernels.int8_pack16(int8)
        int8_packed = linear_kernels.int8_pack16(int8.clone(), in_place=True)
    finally:
        linear_kernels.PACK_CHUNK_BYTES = monkey
    assert packed.untyped_storage().data_ptr() == storage and torch.equal(packed, expected)
    assert torch.equal(int8_packed, int8_expected)
    with pytest.raises(ValueError, match="multiple of 64 channels"):
        linear_kernels.bf16_pack(torch.randn(70, 96).to(torch.bfloat16), in_place=True)


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_linear_is_bit_identical_to_f_linear(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.weight.is_mkldnn
    assert torch.equal(packed(x), linear(x))
    assert torch.equal(packed(x.t().contiguous().t()), linear(x))  # a strided input too


def _decode(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = ["Hello there", "A longer prompt, so that prefill and decode both run a few rows"]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same_decode(ours: list, reference: list, exact: bool) -> None:
    """The same tokens; logprobs equal (`exact`) or within bfloat16 rounding of the reference's."""
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    if exact:
        assert [o.logprobs for o in ours] == [o.logprobs for o in reference]
        return
    for mine, theirs in zip(ours, reference):
        for a, b in zip(mine.logprobs, theirs.logprobs):
            chosen = next(iter(b))
            assert abs(a[chosen].logprob - b[chosen].logprob) < 0.05


@needs_packing
def test_bfloat16_engine_packs_every_linear_and_decodes_as_unpacked(llama_dir, monkeypatch):
    packed = LLM(str(llama_dir), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    kind = Bf16Linear if bf16_kernel() is not None else PackedLinear
    linears = [m for m in packed.engine.model.modules() if isinstance(m, (nn.Linear, *PACKED))]
    assert linears and all(isinstance(m, kind) for m in linears)
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype, device: False)
    plain = LLM(str(llama_dir), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    assert not any(isinstance(m, PACKED) for m in plain.engine.model.modules())
    _assert_same_decode(_decode(packed), _decode(plain), exact=kind is PackedLinear)


@needs_packing
def test_without_the_c_kernel_the_engine_packs_in_onednn_layout_bit_for_bit(llama_dir, monkeypatch):
    monkeypatch.setattr(packed_linear, "bf16_kernel", lambda: None)
    packed = LLM(str(llama_dir), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    linears = [m for m in packed.engine.model.modules() if isinstance(m, (nn.Linear, *PACKED))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype, device: False)
    plain = LLM(str(llama_dir), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    _assert_same_decode(_decode(packed), _decode(plain), exact=True)


@needs_packing
def test_a_tied_lm_head_gets_a_packed_copy_and_the_same_logits(tmp_path, monkeypatch):
    """Tied word embeddings: the logits go through the packed embedding matrix, token for token as
    unpacked. In the C kernel's layout the lookups read that same matrix (held once); in oneDNN's
    the embedding keeps its own."""
    path = make_tiny_model("llama", tmp_path / "tied", seed=2, tie_word_embeddings=True)
    packed = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    model = packed.engine.model
    kind = Bf16Linear if bf16_kernel() is not None else PackedLinear
    assert isinstance(model.lm_head, kind)
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype, device: False)
    plain = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    assert plain.engine.model.lm_head is None
    embedding = plain.engine.model.embed_tokens
    if kind is Bf16Linear:
        assert isinstance(model.embed_tokens, PackedEmbedding) and model.embed_tokens.packed is model.lm_head.packed
        assert torch.equal(model.embed_tokens.weight, embedding.weight)
        ids = torch.tensor([[0, 7, embedding.num_embeddings - 1], [3, 3, 1]])
        assert torch.equal(model.embed_tokens(ids), embedding(ids))
        with pytest.raises(IndexError, match="out of range"):
            model.embed_tokens(torch.tensor([embedding.num_embeddings]))
        held = sum(p.numel() for p in model.parameters())  # the matrix once (and its channels padded to 64)
        assert held < sum(p.numel() for p in plain.engine.model.parameters()) + 64 * embedding.embedding_dim
    else:
        assert not model.embed_tokens.weight.is_mkldnn
    _assert_same_decode(_decode(packed), _decode(plain), exact=kind is PackedLinear)


def test_nothing_is_packed_where_it_would_not_be_exact(llama_dir):
    model = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20).engine.model
    assert not any(isinstance(m, PACKED) for m in model.modules())
    assert pack_linears(nn.Sequential(nn.Linear(4, 4, bias=False)), torch.float32, CPU) == 0
    assert not can_pack(torch.float16, CPU)
    with_bias = nn.Sequential(nn.Linear(4, 4, bias=True)).to(torch.bfloat16)
    if cpu_has_fast_bf16():
        with pytest.MonkeyPatch.context() as patch:  # oneDNN's layout only: F.linear adds a bias in another order
            patch.setattr(packed_linear, "bf16_kernel", lambda: None)
            assert pack_linears(with_bias, torch.bfloat16, CPU) == 0
        if bf16_kernel() is not None:  # the C kernel adds it before its one rounding
            assert pack_linears(with_bias, torch.bfloat16, CPU) == 1 and isinstance(with_bias[0], Bf16Linear)
    with pytest.raises(ValueError, match="without bias"):
        PackedLinear(with_bias[0])


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_float32_linear_is_the_float32_product_rounded_once(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).to(torch.bfloat16)
    linear.__class__ = Float32Linear
    assert torch.equal(linear(x), expected)
    assert linear(x).dtype == torch.bfloat16


@pytest.mark.skipif(cpu_has_fast_bf16(), reason="hardware: this CPU has bf16 units: its bf16 linears are packed, not upcast")
def test_bfloat16_engine_without_bf16_units_computes_in_float32(tmp_path, monkeypatch):
    from treeserve.model import moe
    from treeserve.testing.tiny_models import make_tiny_model
    path = make_tiny_model("mixtral", tmp_path / "mixtral", seed=2)
    prompt = list(range(20, 60))

    def logits():
        llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
        llm.engine.add_request("r", prompt, SamplingParams(), logits_positions=list(range(len(prompt))))
        out = {}
        while llm.engine.has_unfinished_requests():
            out.update({o.request_id: o for o in llm.engine.step() if o.finished})
        return llm, torch.stack([out["r"].prompt_logits[p] for p in range(len(prompt))])
    upcast, ours = logits()
    linears = [m for m in upcast.engine.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is Float32Linear for m in linears)
    monkeypatch.setattr(packed_linear, "_compute_in_float32", lambda model: 0)
    monkeypatch.setattr(moe, "computes_in_float32", lambda x: False)
    plain, reference = logits()
    assert not any(type(m) is Float32Linear for m in plain.engine.model.modules())
    assert float((ours - reference).abs().max() / reference.abs().max()) < 3e-2  # bf16's rounding, not more
