"""Quantized weights. `quantization="int8"` (weight-only int8 made at load) against HF transformers
running the same weights dequantized (each projection's and the LM head's rows rounded to scale x
int8, as model/quantization/int8.py and int8_head.py do; a tied head's embedding with it), on every family's tiny model: greedy tokens and logprobs, with chunked
prefill and a prefix-cache hit, and a batch whose prefill takes the dequantized-GEMM path.
Checkpoints quantized with schemes treeserve cannot load are refused by name."""
import json
import shutil

from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from conftest import assert_no_leak
from test_hf_parity import PROMPTS, _hf_greedy, _hf_logits
from treeserve import LLM, SamplingParams
from treeserve.errors import ParamError
from treeserve.model.quantization import QUANTIZED_PROJECTIONS, Int8Embedding, Int8Linear
from treeserve.model.random_models import GEMMA_FAMILIES, MOE_FAMILIES, PHI3_ORIGINAL_POSITIONS, make_tiny_model
from treeserve.testing.tiny_models import FAMILIES

ALL_FAMILIES = FAMILIES + ("phi3",) + GEMMA_FAMILIES + MOE_FAMILIES
# HF's names of the projections treeserve quantizes (Phi-3's are fused there too); experts stay as stored
HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                  "down_proj")
OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, quantization="int8")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-families")
    return {family: make_tiny_model(family, root / family, seed=1) for family in ALL_FAMILIES}


@torch.no_grad()
def _hf_dequantized(path) -> nn.Module:
    """HF's model with every projection and the LM head (a tied one's embedding with it: the same
    matrix) rounded to scale x int8 per row."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    changed = 0
    for name, module in hf.model.layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in HF_PROJECTIONS and ".experts." not in name:
            _round_rows_to_int8(module.weight)
            changed += 1
    assert changed >= 4 * hf.config.num_hidden_layers  # q, k, v (or qkv), o and the MLP's, where not experts
    head = hf.get_output_embeddings().weight
    _round_rows_to_int8(head)
    assert (head is hf.get_input_embeddings().weight) == bool(hf.config.tie_word_embeddings)
    return hf


def _round_rows_to_int8(weight: torch.Tensor) -> None:
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    weight.copy_(torch.round(weight.float() / scales[:, None]).clamp(-127, 127) * scales[:, None])


def _check_greedy(llm: LLM, hf: nn.Module, prompts: list[str], family: str) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        ids, tokens = output.prompt_token_ids, output.outputs[0].token_ids
        if family == "phi3" and len(ids) <= PHI3_ORIGINAL_POSITIONS < len(ids) + MAX_TOKENS:
            continue  # LongRoPE's switch mid-sequence: HF recomputes its cache there, treeserve (as vLLM) not
        assert tokens == _hf_greedy(hf, ids, MAX_TOKENS), family
        ref = torch.log_softmax(_hf_logits(hf, ids + tokens), dim=-1)
        for step, (token, entry) in enumerate(zip(tokens, output.outputs[0].logprobs)):
            assert abs(entry[token].logprob - float(ref[len(ids) - 1 + step][token])) < 1e-4, family
    return outputs


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_int8_matches_hf_on_the_dequantized_weights(family_dirs, family):
    path = family_dirs[family]
    hf = _hf_dequantized(path)
    # every prompt in one batch: the first step's prefill takes the dequantized-GEMM path, decodes the int8 one
    llm = LLM(str(path), **OPTIONS)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) >= 2 * len(llm.engine.model.layers) and all(m.weight.dtype == torch.int8 for m in layers)
    assert isinstance(llm.engine.model.lm_head, Int8Linear)
    assert isinstance(llm.engine.model.embed_tokens, Int8Embedding) == bool(hf.config.tie_word_embeddings)
    _check_greedy(llm, hf, PROMPTS, family)
    assert_no_leak(llm.engine)
    # 16-token chunks, twice: chunked prefill, then a prefix-cache hit
    chunked = LLM(str(path), max_num_batched_tokens=16, **OPTIONS)
    first = _check_greedy(chunked, hf, [PROMPTS[2], PROMPTS[7]], family)
    again = _check_greedy(chunked, hf, [PROMPTS[2], PROMPTS[7]], family)
    assert all(b.num_cached_tokens > 0 and a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(first, again))
    assert_no_leak(chunked.engine)


def test_int8_in_bfloat16_stays_close_to_float32(family_dirs):
    path = str(family_dirs["llama"])
    ids = LLM(path, **OPTIONS).get_tokenizer().encode(PROMPTS[7])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, **{**OPTIONS, "dtype": dtype})
        llm.engine.add_request("x", ids, SamplingParams(), logits_positions=list(range(len(ids))))
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                logits[dtype] = torch.stack([out.prompt_logits[p].float() for p in range(len(ids))])
    error = (logits["bfloat16"] - logits["float32"]).abs().max() / logits["float32"].abs().max()
    assert error < 0.05, float(error)


def test_bfloat16_rows_as_16_bit_integers_keep_each_span_of_inputs_exact():
    """On AVX512-BF16 + VNNI CPUs bfloat16 rows enter the packed int8 kernel as 16-bit integers under
    one power of two per 256 inputs: within one bfloat16 unit of the exact product, also where one span
    of a row is 10^6 times smaller than another (one scale per row would round it away), zeros
    give zeros and a NaN or infinity gives NaN."""
    from treeserve.model import cpu_kernels, linear_kernels

    library = cpu_kernels.load()
    if library is None or not library.ts_int8_rows16():
        pytest.skip("hardware: no AVX512-BF16 and VNNI here (bfloat16 rows take the bfloat16 dot products)")
    gen = torch.Generator().manual_seed(3)
    layer = Int8Linear(nn.Linear(768, 40, bias=False))
    weight = layer.weight.clone()
    weight[:20, :256] = 0  # channels 0-19 see only inputs 256-767: the small spans below
    x = torch.randn(6, 768, generator=gen)
    x[:, 256:] *= 1e-6
    x = x.to(torch.bfloat16)
    exact = (x.double() @ (weight.double() * layer.scales.double()[:, None]).T)
    unit = exact.abs().to(torch.bfloat16).double() * 2.0 ** -7  # one bfloat16 unit (8-bit significand)
    packed = linear_kernels.int8_pack16(weight)

    def product(rows):
        return linear_kernels.int8_linear_packed16(library, rows, packed, layer.scales, 40)

    assert ((product(x).double() - exact).abs() <= unit + 1e-30).all()
    assert (product(torch.zeros(2, 768, dtype=torch.bfloat16)) == 0).all()
    bad = x.clone()
    bad[0, 5], bad[1, 700] = float("nan"), float("inf")
    poisoned = product(bad).float()
    assert poisoned[:2].isnan().all() and not poisoned[2:].isnan().any()


@pytest.mark.parametrize("in_features", [96, 768])  # one short span; three
def test_the_packed_int8_layer_matches_the_dequantized_product(in_features):
    """bfloat16 int8 layers hold their weight in the packed kernel's layout only: every tile height
    (1-6 rows), many rows (where row-major layers dequantize), channels past a block of 64, a bias,
    and the weight read back."""
    from treeserve.model import cpu_kernels

    library = cpu_kernels.load()
    if library is None or not library.ts_int8_rows16():
        pytest.skip("hardware: no AVX512-BF16 and VNNI here (bfloat16 int8 layers stay row-major)")
    torch.manual_seed(1)
    linear = nn.Linear(in_features, 70).to(torch.bfloat16)
    layer, plain = Int8Linear(linear), Int8Linear(linear, pack=False)
    assert layer.packed and not plain.packed and layer.weight.numel() == 128 * in_features
    assert torch.equal(layer.dequantized(torch.float32), plain.dequantized(torch.float32).clone())
    reference = plain.dequantized(torch.float32).clone()
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 64, 200):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        ref = x.float() @ reference.T + linear.bias.detach().float()
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 70)
        assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max())), rows


def test_int8_weights_take_one_byte_each(family_dirs):
    path = str(family_dirs["qwen2"])
    plain = {n: p for n, p in LLM(path, dtype="float32", device="cpu").engine.model.named_parameters()}
    quantized = LLM(path, **OPTIONS).engine.model
    for name, module in quantized.named_modules():
        if isinstance(module, Int8Linear):
            stored = plain[f"{name}.weight" if name != "lm_head" else "embed_tokens.weight"]  # (a tied head)
            assert module.weight.element_size() == 1 and module.weight.shape == stored.shape
            assert module.scales.shape == (stored.shape[0],)
    # the tied head's matrix held once, as int8: its embedding reads the head's rows
    assert isinstance(quantized.embed_tokens, Int8Embedding) and quantized.embed_tokens.quantized is quantized.lm_head.weight
    assert sum(p.numel() for p in quantized.parameters() if p.dtype == torch.int8) == sum(
        p.numel() for n, p in plain.items() if n.endswith("proj.weight") or n == "embed_tokens.weight")


def _quantized_checkpoint(tmp_path, source, config: dict):
    path = tmp_path / "quantized"
    shutil.copytree(source, path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "exl2", "bits": 4}, "'exl2', 4 bits"),
])
def test_a_checkpoint_quantized_by_another_tool_is_refused_by_name(tmp_path, family_dirs, config, named):
    path = _quantized_checkpoint(tmp_path, family_dirs["llama"], config)
    with pytest.raises(ParamError, match=f"quantized with {named}.*cannot load yet") as caught:
        LLM(path, dtype="float32", device="cpu")
    assert caught.value.param == "quantization"
    with pytest.raises(ParamError, match=f"'int8' was asked for, but the checkpoint is quantized with {named.split(',')[0]}"):
        LLM(path, dtype="float32", device="cpu", quantization="int8")


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "'awq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}, "'compressed-tensors'"),
])
def test_a_loadable_scheme_without_quantized_tensors_is_refused_by_name(tmp_path, family_dirs, config, named):
    """GPTQ, AWQ and compressed-tensors load (tests/test_quantized_checkpoints.py); a config.json that
    names one over float tensors is a broken checkpoint, not a float one."""
    path = _quantized_checkpoint(tmp_path, family_dirs["llama"], config)
    with pytest.raises(ParamError, match=f"quantized with {named}, but none of its tensors is") as caught:
        LLM(path, dtype="float32", device="cpu")
    assert caught.value.param == "quantization"
    with pytest.raises(ParamError, match=f"'int8' was asked for, but the checkpoint is quantized with {named}"):
        LLM(path, dtype="float32", device="cpu", quantization="int8")


def test_unknown_schemes_and_unsupported_settings_are_clear_errors(family_dirs):
    path = str(family_dirs["llama"])
    with pytest.raises(ParamError, match="must be one of int8 .*got 'int4'"):
        LLM(path, dtype="float32", device="cpu", quantization="int4")
    with pytest.raises(ParamError, match="float32 or bfloat16 activations"):
        LLM(path, dtype="float16", device="cpu", quantization="int8")
    # "none" (the help's and these errors' word for the weights as stored) was itself refused
    from treeserve.model.quantization.scheme import resolve_quantization
    assert resolve_quantization("none", family_dirs["llama"]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_kernel_matches_the_dequantized_product(dtype):
    """Odd shapes: channels not a multiple of the 4-channel tile, every row count of a short tile."""
    from treeserve.model import cpu_kernels, linear_kernels

    library = cpu_kernels.load()
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(96, 70, bias=False).to(dtype), pack=False)  # the row-major kernel
    if library is None or linear_kernels.int8_linear(library, torch.ones(1, 96, dtype=dtype), layer.weight,
                                                  layer.scales) is None:
        pytest.skip("hardware: no AVX512 here (or no C compiler): PyTorch's int8 kernel runs instead")
    for rows in (1, 2, 3, 4, 5, 9, 31):
        x = torch.randn(rows, 96, dtype=dtype)
        out = linear_kernels.int8_linear(library, x, layer.weight, layer.scales)
        ref = x.float() @ (layer.weight.float() * layer.scales[:, None]).T
        assert out.dtype == dtype and out.shape == (rows, 70)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out.float(), ref, rtol=tolerance, atol=tolerance * float(ref.abs().max())), rows
    odd = Int8Linear(nn.Linear(48, 9, bias=False).to(dtype), pack=False)  # 48: a multiple of 16, not of the bf16 path's 32
    x = torch.randn(5, 48, dtype=dtype)
    ref = x.float() @ (odd.weight.float() * odd.scales[:, None]).T
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(linear_kernels.int8_linear(library, x, odd.weight, odd.scales).float(), ref, rtol=tolerance,
                          atol=tolerance * float(ref.abs().max()))
    narrow = Int8Linear(nn.Linear(40, 8, bias=False).to(dtype), pack=False)  # 40 inputs: not the kernel's multiple of 16
    assert linear_kernels.int8_linear(library, torch.ones(2, 40, dtype=dtype), narrow.weight, narrow.scales) is None
    assert narrow(torch.ones(2, 40, dtype=dtype)).shape == (2, 8)  # PyTorch's kernel instead


def test_quantizing_leaves_the_float_weight_as_it_was(monkeypatch):
    """The channels are quantized from a float32 weight without writing to it (a vocabulary-parallel
    embedding tied to the head keeps reading its own rows), in slices smaller than the weight."""
    from treeserve.model.quantization import int8

    monkeypatch.setattr(int8, "QUANTIZE_SLICE_WEIGHTS", 64 * 64)  # 64 channels a slice
    weight = torch.randn(300, 64)
    kept = weight.clone()
    quantized, scales = int8.quantize_channels(weight)
    assert torch.equal(weight, kept)
    expected = kept.abs().amax(dim=1) / 127.0
    assert torch.equal(scales, expected) and torch.equal(quantized, torch.round(kept / expected[:, None]).to(torch.int8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_int8_heads_lookups_are_its_dequantized_rows(family_dirs, dtype):
    """A tied head's embedding reads the head's int8 rows, in either layout (bfloat16 on AVX512-BF16 +
    VNNI CPUs: the packed one, a gather of each row's runs): scale x int8 rounded to the dtype."""
    model = LLM(str(family_dirs["qwen2"]), **{**OPTIONS, "dtype": dtype}).engine.model
    head, embedding = model.lm_head, model.embed_tokens
    assert isinstance(embedding, Int8Embedding) and embedding.quantized is head.weight
    ids = torch.tensor([[0, 5, head.out_features - 1], [64, 63, 1]])
    expected = head.dequantized(torch.float32)[ids].to(getattr(torch, dtype))
    assert torch.equal(embedding(ids), expected)
    with pytest.raises(IndexError, match="token id out of range"):
        embedding(torch.tensor([head.out_features]))


def test_int8_quantizes_each_projection_as_the_checkpoint_is_read(family_dirs, monkeypatch):
    """On-the-fly int8 never allocates the projections' float weights nor the LM head's (qwen2's is tied:
    its embedding's) (model/quantization/int8_stream.py): a load peaks near the int8 model's size, not
    the float model's."""
    from treeserve.model import loader

    materialized, original = [], loader.materialize

    def spy(model, device, dtype):
        materialized.extend(name for name, _ in model.named_parameters()
                            if name.endswith(tuple(f".{p}.weight" for p in QUANTIZED_PROJECTIONS))
                            or name in ("embed_tokens.weight", "lm_head.weight"))
        return original(model, device, dtype)

    monkeypatch.setattr(loader, "materialize", spy)
    model = LLM(str(family_dirs["qwen2"]), **OPTIONS).engine.model
    assert materialized == []
    assert all(isinstance(getattr(layer.self_attn, "qkv_proj"), Int8Linear) and layer.self_attn.qkv_proj.bias is not None
               for layer in model.layers)  # qwen2's q/k/v biases loaded into the int8 layers
    assert isinstance(model.embed_tokens, Int8Embedding) and model.embed_tokens.quantized is model.lm_head.weight
