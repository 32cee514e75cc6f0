"""bfloat16 linears on CPU: oneDNN-packed where the CPU has fast bf16 (exact, and used by the
engine), float32 products where it has none (the same products in another summation order; the
engine's logits within bf16 rounding of plain bf16 matmuls, MoE experts included)."""
import pytest
import torch
from torch import nn

from treeserve import LLM, SamplingParams
from treeserve.model import packed_linear
from treeserve.config import cpu_has_fast_bf16
from treeserve.model.packed_linear import Float32Linear, PackedLinear, can_pack, pack_linears
from treeserve.model.random_models import make_tiny_model

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not can_pack(torch.bfloat16, CPU),
                                   reason="hardware: this CPU has no fast bfloat16 (AVX512-BF16 or AMX) or torch no oneDNN")


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


@needs_packing
def test_bfloat16_engine_packs_every_linear_and_decodes_as_unpacked(llama_dir, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    packed = LLM(str(llama_dir), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    linears = [m for m in packed.engine.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype, device: False)
    plain = LLM(str(llama_dir), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.model.modules())
    prompts = ["Hello there", "A longer prompt, so that prefill and decode both run a few rows"]
    ours = [o.outputs[0] for o in packed.generate(prompts, params, use_tqdm=False)]
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert [o.logprobs for o in ours] == [o.logprobs for o in reference]


@needs_packing
def test_a_tied_lm_head_gets_a_packed_copy_and_the_same_logits(tmp_path, monkeypatch):
    """Tied word embeddings: the logits go through a packed copy of the embedding matrix (the
    embedding keeps its own for lookups), token for token and logprob for logprob as unpacked."""
    path = make_tiny_model("llama", tmp_path / "tied", seed=2, tie_word_embeddings=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    packed = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    model = packed.engine.model
    assert isinstance(model.lm_head, PackedLinear) and not model.embed_tokens.weight.is_mkldnn
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype, device: False)
    plain = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=4 << 20)
    assert plain.engine.model.lm_head is None
    prompts = ["Hello there", "A longer prompt, so that prefill and decode both run a few rows"]
    ours = [o.outputs[0] for o in packed.generate(prompts, params, use_tqdm=False)]
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert [o.logprobs for o in ours] == [o.logprobs for o in reference]


def test_nothing_is_packed_where_it_would_not_be_exact(llama_dir):
    model = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20).engine.model
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert pack_linears(nn.Sequential(nn.Linear(4, 4, bias=False)), torch.float32, CPU) == 0
    assert not can_pack(torch.float16, CPU)
    with_bias = nn.Sequential(nn.Linear(4, 4, bias=True)).to(torch.bfloat16)
    if cpu_has_fast_bf16():
        assert pack_linears(with_bias, torch.bfloat16, CPU) == 0  # F.linear adds a bias in another order
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
