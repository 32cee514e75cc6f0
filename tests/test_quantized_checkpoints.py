"""Checkpoints quantized by other tools (GPTQ, AWQ, compressed-tensors) against HF transformers.

References: compressed-tensors checkpoints are written by the compressed-tensors library itself and
HF transformers loads the same checkpoint (its compressed-tensors integration: weights dequantized,
W8A8's and FP8's activations quantized per token as the scheme says); asymmetric W4A16, which
transformers 5.24 cannot load, against compressed-tensors' own decompressor's weights in a float HF
model; GPTQ and AWQ against a float HF model holding the packer's integers dequantized in float32
(tests/quantized_checkpoints.py). Greedy tokens over 32 steps equal HF's in float32; where the
activations are quantized at run time (W8A8, FP8) a 1e-6 difference can move one activation across
a rounding step, so there the tokens may part only at a near tie of HF's logits (top-2 gap under
`ACTIVATION_TIE`), and the prompt's logits agree within 1e-4 at the positions no flipped rounding
reached (a flip moves its position and, through its K/V, every later one) and within 5% of the
largest logit elsewhere; the W8A8 layer itself matches compressed-tensors' formula within 1e-5.
Also MoE checkpoints (experts quantized: GPTQ, AWQ), every other family (GPTQ in act order), chunked
prefill with a prefix-cache hit. float32 runs 4-bit weights dequantized at load (the int4 kernel's
float32 path is a plain loop): the bfloat16 kernels (int4, int8, W8A8) are checked layer by layer
against the dequantized product, and end to end against the float32 model.
"""
import json
import shutil

import pytest
import torch
import transformers
from torch import nn

from conftest import assert_no_leak
from quantized_checkpoints import (AWQ_ORDER, compressed_tensors_reference, make_awq, make_compressed_tensors,
                                   make_compressed_tensors_per_tensor, make_gptq, pack_columns, pack_rows)
from test_hf_parity import PROMPTS, _hf_greedy, _hf_logits
from treeserve import LLM, SamplingParams
from treeserve.errors import ParamError
from treeserve.model import cpu_kernels
from treeserve.model.quantization import Int8Linear, int4_csrc
from treeserve.model.quantization.activations import Fp8InputLinear, Int8W8A8Linear
from treeserve.model.quantization.formats import unpack_int32
from treeserve.model.quantization.int4 import DEQUANTIZE_FROM_ROWS, Int4Linear, unpack_int4pack
from treeserve.model.quantization.int4_csrc import CsrcInt4Linear, csrc_int4_runs
from treeserve.model.quantization.weights import FloatWeight, IntWeight, concat_rows
from treeserve.model.random_models import GEMMA_FAMILIES, MOE_FAMILIES, make_tiny_model
from treeserve.testing.tiny_models import FAMILIES

MAX_TOKENS = 32
ACTIVATION_TIE = 0.25
OPTIONS = dict(device="cpu", kv_cache_memory_bytes=8 << 20)
# intermediate 256: groups of 32, 64 and 128 divide every width (160, the default, only 32)
SHAPES = {"llama": {}, "qwen2": dict(intermediate_size=256), "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}}

CHECKPOINTS = {  # name: (family, how it is made)
    "gptq-4bit-g32-sym": ("llama", dict(kind="gptq", bits=4, group_size=32)),
    "gptq-4bit-g128-asym-actorder": ("qwen2", dict(kind="gptq", bits=4, group_size=128, sym=False, desc_act=True)),
    "gptq-4bit-g64-actorder-moe": ("mixtral", dict(kind="gptq", bits=4, group_size=64, desc_act=True)),
    "gptq-4bit-channel": ("qwen2", dict(kind="gptq", bits=4, group_size=-1)),
    "gptq-8bit-channel": ("llama", dict(kind="gptq", bits=8, group_size=-1)),
    "gptq-8bit-g32-asym": ("qwen2_moe", dict(kind="gptq", bits=8, group_size=32, sym=False)),
    "gptq-v2-4bit-g32-asym": ("llama", dict(kind="gptq", bits=4, group_size=32, sym=False, v2=True)),
    "gptq-4bit-g32-lm-head": ("llama", dict(kind="gptq", bits=4, group_size=32, lm_head=True)),
    "awq-g32": ("llama", dict(kind="awq", group_size=32)),
    "awq-g64-moe": ("qwen3_moe", dict(kind="awq", group_size=64)),
    "ct-w4a16": ("llama", dict(kind="ct", preset="W4A16")),
    "ct-w4a16-asym": ("qwen2", dict(kind="ct", preset="W4A16_ASYM")),
    "ct-w4a16-moe": ("qwen3_moe", dict(kind="ct", preset="W4A16")),
    "ct-w4a16-experts": ("mixtral", dict(kind="ct-tensors")),
    "ct-w8a16": ("llama", dict(kind="ct", preset="W8A16")),
    "ct-w8a16-channel": ("qwen2", dict(kind="ct", preset="W8A16", strategy="channel")),
    "ct-w8a8": ("llama", dict(kind="ct", preset="W8A8")),
    "ct-w8a8-qwen2": ("qwen2", dict(kind="ct", preset="W8A8")),
    "ct-fp8-dynamic": ("qwen2", dict(kind="ct", preset="FP8_DYNAMIC")),
    "ct-fp8-static": ("llama", dict(kind="ct", preset="FP8")),
}
ACTIVATIONS_QUANTIZED = ("ct-w8a8", "ct-w8a8-qwen2", "ct-fp8-dynamic", "ct-fp8-static")
# transformers 5.24 loads neither asymmetric pack-quantized weights nor compressed-tensors MoE checkpoints
DECOMPRESSED_REFERENCE = ("ct-w4a16-asym", "ct-w4a16-moe", "ct-w4a16-experts")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-sources")
    return {f: make_tiny_model(f, root / f, seed=3, **SHAPES[f]) for f in SHAPES}


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory):
    """name -> (quantized checkpoint, the directory HF loads as its reference)."""
    root, made = tmp_path_factory.mktemp("quantized"), {}

    def make(name):
        if name not in made:
            family, recipe = CHECKPOINTS[name]
            recipe = dict(recipe)
            kind, source, dest = recipe.pop("kind"), sources[family], root / name
            if kind == "gptq":
                made[name] = make_gptq(source, dest, root / f"{name}-ref", **recipe), root / f"{name}-ref"
            elif kind == "awq":
                made[name] = make_awq(source, dest, root / f"{name}-ref", **recipe), root / f"{name}-ref"
            else:
                pytest.importorskip("compressed_tensors", reason="the test extra's compressed-tensors is not installed")
                maker = make_compressed_tensors_per_tensor if kind == "ct-tensors" else make_compressed_tensors
                path = maker(source, dest, **recipe)
                decompressed = name in DECOMPRESSED_REFERENCE
                made[name] = path, compressed_tensors_reference(path, root / f"{name}-ref") if decompressed else path
        return made[name]
    return make


def _hf(path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _check_greedy(llm: LLM, hf: nn.Module, prompts: list[str], tie: float = 0.0) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        ids, tokens = output.prompt_token_ids, output.outputs[0].token_ids
        expected = _hf_greedy(hf, ids, MAX_TOKENS)
        if tokens == expected:
            continue
        parted = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        top = _hf_logits(hf, ids + expected[:parted])[-1].topk(2).values
        assert tie > 0 and float(top[0] - top[1]) < tie, (parted, tokens, expected)
    return outputs


def _prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    llm.engine.add_request("logits", ids, SamplingParams(), logits_positions=list(range(len(ids))))
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            logits = torch.stack([out.prompt_logits[p].float() for p in range(len(ids))])
    return logits


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_quantized_checkpoint_matches_hf_in_float32(checkpoints, name):
    path, reference = checkpoints(name)
    hf = _hf(reference)
    tie = ACTIVATION_TIE if name in ACTIVATIONS_QUANTIZED else 0.0
    llm = LLM(str(path), dtype="float32", **OPTIONS)
    stored = json.loads(path.joinpath("config.json").read_text())["quantization_config"]["quant_method"]
    assert llm.engine.loaded.quantization == stored
    _check_greedy(llm, hf, PROMPTS[:4], tie)
    ids = llm.get_tokenizer().encode(PROMPTS[7])
    ref = _hf_logits(hf, ids)
    errors = (_prompt_logits(llm, ids) - ref).abs().amax(dim=-1)
    if tie:  # positions no flipped activation rounding reached as close as float32 allows, the rest within ~5%
        assert float(errors.min()) < 1e-4 and float(errors.max() / ref.abs().max()) < 0.05, errors
    else:
        assert float(errors.max()) < 1e-4, errors
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("family", [f for f in FAMILIES + ("phi3",) + GEMMA_FAMILIES + MOE_FAMILIES
                                    if f not in SHAPES])
def test_every_family_loads_gptq_act_order(tmp_path, family):
    """The families the checkpoints above do not cover (biases and tied embeddings, Phi-3's
    checkpoint-fused qkv and gate/up, Gemma's GeGLU, sliding windows, q/k norms), GPTQ 4-bit in act
    order: float32 greedy tokens equal HF's on the dequantized weights; bfloat16 runs the int4 kernel."""
    source = make_tiny_model(family, tmp_path / "source", seed=5)
    path = make_gptq(source, tmp_path / "gptq", tmp_path / "ref", bits=4, group_size=32, desc_act=True)
    # Phi-3: prompt and tokens within its LongRoPE switch (past 48 positions HF recomputes its cache, we do not)
    prompts = PROMPTS[:2] if family != "phi3" else PROMPTS[:1]
    _check_greedy(LLM(str(path), dtype="float32", **OPTIONS), _hf(tmp_path / "ref"), prompts)
    model = LLM(str(path), dtype="bfloat16", **OPTIONS).engine.model
    library = cpu_kernels.load()
    expected = CsrcInt4Linear if library is not None and library.ts_int4_supported() == 1 else Int4Linear
    assert sum(isinstance(m, expected) for m in model.modules()) >= 2 * len(model.layers)


@pytest.mark.parametrize("name", ["gptq-4bit-g64-actorder-moe", "awq-g32", "ct-w8a8"])
def test_chunked_prefill_and_a_prefix_cache_hit(checkpoints, name):
    path, reference = checkpoints(name)
    hf = _hf(reference)
    tie = ACTIVATION_TIE if name in ACTIVATIONS_QUANTIZED else 0.0
    chunked = LLM(str(path), dtype="float32", max_num_batched_tokens=16, **OPTIONS)
    first = _check_greedy(chunked, hf, [PROMPTS[2], PROMPTS[7]], tie)
    again = _check_greedy(chunked, hf, [PROMPTS[2], PROMPTS[7]], tie)
    assert all(b.num_cached_tokens > 0 and a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(first, again))
    assert_no_leak(chunked.engine)


# the 4-bit layers: treeserve's kernel where the CPU has AVX512-BF16, PyTorch's elsewhere
INT4_LAYERS = (CsrcInt4Linear, Int4Linear)


@pytest.mark.parametrize("name,layer", [("gptq-4bit-g32-sym", INT4_LAYERS), ("gptq-4bit-g128-asym-actorder", INT4_LAYERS),
                                        ("gptq-4bit-g64-actorder-moe", INT4_LAYERS),
                                        ("awq-g32", INT4_LAYERS), ("ct-w4a16", INT4_LAYERS), ("ct-w8a8", Int8W8A8Linear),
                                        ("gptq-8bit-channel", Int8Linear), ("ct-w8a16-channel", Int8Linear),
                                        ("ct-fp8-dynamic", Fp8InputLinear), ("ct-fp8-static", Fp8InputLinear)])
def test_bfloat16_runs_the_kernels_and_stays_close_to_float32(checkpoints, name, layer):
    path, _ = checkpoints(name)
    llm = LLM(str(path), dtype="bfloat16", **OPTIONS)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, layer)]
    assert len(layers) >= 2 * len(llm.engine.model.layers)
    if layer is Fp8InputLinear:  # the static scheme's stored input scale, the dynamic one's none
        assert all((m.input_scale is not None) == name.endswith("static") for m in layers)
    ids = llm.get_tokenizer().encode(PROMPTS[7])
    ours = _prompt_logits(llm, ids)
    ref = _prompt_logits(LLM(str(path), dtype="float32", **OPTIONS), ids)
    # quantized activations: bfloat16's own rounding moves some across a rounding step (FP8's steps are 1/16)
    bound = 0.25 if name in ACTIVATIONS_QUANTIZED else 0.05
    errors = (ours - ref).abs().amax(dim=-1) / ref.abs().max()
    # MoE: bfloat16 routes a few tokens to other experts than float32 does (the float model's too)
    moe = CHECKPOINTS[name][0] in ("mixtral", "qwen2_moe", "qwen3_moe")
    assert float(errors.median() if moe else errors.max()) < bound, errors


def test_a_quantized_lm_head_runs_the_4bit_kernel(checkpoints, tmp_path):
    """GPTQModel's `lm_head=True` (vLLM loads it, `lm_head_quantized`): the head's 4-bit layer in
    bfloat16 (its parity in float32 is the checkpoints' test above); a checkpoint whose config ties
    the head to the embeddings but stores the head quantized is refused by name."""
    path, _ = checkpoints("gptq-4bit-g32-lm-head")
    assert json.loads(path.joinpath("config.json").read_text())["tie_word_embeddings"] is False
    model = LLM(str(path), dtype="bfloat16", **OPTIONS).engine.model
    assert isinstance(model.lm_head, INT4_LAYERS) and type(model.embed_tokens) is nn.Embedding
    tied = tmp_path / "tied"
    shutil.copytree(path, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ParamError, match="lm_head is quantized in the checkpoint, but its config ties"):
        LLM(str(tied), dtype="bfloat16", **OPTIONS)


def test_float32_dequantizes_4bit_weights_and_ignored_modules_stay_plain(checkpoints):
    path, _ = checkpoints("ct-w4a16")
    model = LLM(str(path), dtype="float32", **OPTIONS).engine.model
    assert not any(isinstance(m, INT4_LAYERS) for m in model.modules())
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32  # in `ignore`
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (128, 64)  # q, k, v fused


@pytest.mark.parametrize("layer_class,rows", [(Int4Linear, 1), (Int4Linear, 5), (Int4Linear, 33),
                                              (Int4Linear, DEQUANTIZE_FROM_ROWS),  # unpacked, dequantized GEMM
                                              (CsrcInt4Linear, 1), (CsrcInt4Linear, 5),
                                              (CsrcInt4Linear, int4_csrc.DEQUANTIZE_FROM_ROWS)])
@pytest.mark.parametrize("act_order", [False, True])
def test_the_int4_kernel_matches_the_dequantized_product(layer_class, rows, act_order):
    torch.manual_seed(0)
    out_features, in_features, group = 48, 256, 64
    values = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // group) * 0.02 + 0.01
    zeros = torch.randint(0, 16, (out_features, in_features // group)).float()
    g_idx = torch.randperm(in_features) // group if act_order else None
    weight = IntWeight(values, scales, zeros, 4, group, g_idx)
    if layer_class is CsrcInt4Linear and not csrc_int4_runs(weight, torch.bfloat16):
        pytest.skip("hardware: treeserve's int4 kernel needs AVX512-BF16 (and a C compiler)")
    layer = layer_class(weight, None, torch.bfloat16)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    ref = x.float() @ weight.dequantize().t()
    assert torch.allclose(layer(x).float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 64), (64, 160), (128, 96), (208, 256)])
def test_the_int4_layout_reads_back(out_features, in_features):
    if not torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AVX2")):
        pytest.skip("hardware: the int4 layout is read back on AVX512 and AVX2 CPUs only (checked at load)")
    values = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
    assert torch.equal(unpack_int4pack(packed, out_features, in_features).int(), values)


def _random_weight(out_features: int, g_idx=None) -> IntWeight:
    values = torch.randint(0, 16, (out_features, 64), dtype=torch.uint8)
    return IntWeight(values, torch.rand(out_features, 2) + 0.1, torch.randint(0, 16, (out_features, 2)).float(), 4, 32,
                     g_idx)


def test_fused_parts_keep_their_rows_scales_and_zero_points():
    torch.manual_seed(0)
    parts = [_random_weight(32), _random_weight(16), _random_weight(16)]
    fused = concat_rows(parts)
    assert isinstance(fused, IntWeight) and fused.shape == (64, 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    # parts in different act orders cannot share one input permutation: fused dequantized instead
    orders = [_random_weight(16, torch.randperm(64) // 32) for _ in range(2)]
    fused = concat_rows(orders)
    assert isinstance(fused, FloatWeight)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in orders]))


def test_w8a8_quantizes_each_row_as_compressed_tensors_does():
    torch.manual_seed(0)
    values = torch.randint(1, 256, (32, 64), dtype=torch.uint8)
    scales = torch.rand(32, 1) * 0.01
    weight = IntWeight(values, scales, torch.full_like(scales, 128.0), 8, 64, None, "int8_token")
    layer = Int8W8A8Linear(weight, None, torch.float32)
    x = torch.randn(3, 64)
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    fake = torch.round(x / scale).clamp(-128, 127) * scale
    assert torch.allclose(layer(x), fake @ weight.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_packing_follows_the_formats_specifications():
    """The test packers against hand-made words, so that packer and reader cannot share a mistake."""
    values = torch.zeros(16, 8, dtype=torch.int32)
    values[9, 0] = 5  # GPTQ qweight: input feature 9 is nibble 1 of row 1
    assert pack_rows(values, 4)[1, 0] == 5 << 4
    columns = torch.zeros(1, 8, dtype=torch.int32)
    columns[0, 1] = 5  # AWQ: channel 1 sits in nibble 4 of its word (order 0, 2, 4, 6, 1, 3, 5, 7)
    assert pack_columns(columns, 4, AWQ_ORDER)[0, 0] == 5 << 16
    assert unpack_int32(pack_columns(columns, 4, AWQ_ORDER), 4, AWQ_ORDER)[0, 1] == 5
    wide = torch.zeros(1, 4, dtype=torch.int32)
    wide[0, 3] = 200  # 8 bits: four per word, the sign bit set
    assert unpack_int32(pack_columns(wide, 8), 8)[0, 3] == 200


def test_unpacking_in_chunks_reads_the_same_values(monkeypatch):
    """A load unpacks a few rows of words at a time (UNPACK_CHUNK_WORDS); the values are those of
    one pass over them all, a last partial chunk included."""
    from treeserve.model.quantization import formats

    values = torch.randint(0, 16, (37, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    words = pack_columns(values, 4)
    whole = unpack_int32(words, 4)
    monkeypatch.setattr(formats, "UNPACK_CHUNK_WORDS", 8 * 5)  # 5 rows of 8 words: 8 chunks, the last 2 rows
    assert torch.equal(unpack_int32(words, 4), whole) and torch.equal(whole.to(torch.int32), values)


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "exl2", "bits": 4}, "'exl2', 4 bits"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
])
def test_unsupported_checkpoint_schemes_are_refused_by_name(tmp_path, sources, config, named):
    import shutil

    path = tmp_path / "other"
    shutil.copytree(sources["llama"], path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ParamError, match=f"quantized with {named}.*cannot load yet"):
        LLM(str(path), dtype="float32", device="cpu")


def test_asking_for_another_scheme_is_refused(checkpoints, sources):
    path, _ = checkpoints("awq-g32")
    with pytest.raises(ParamError, match="'gptq' was asked for, but the checkpoint is quantized with 'awq'"):
        LLM(str(path), dtype="float32", quantization="gptq", **OPTIONS)
    with pytest.raises(ParamError, match="'int8' was asked for"):
        LLM(str(path), dtype="float32", quantization="int8", **OPTIONS)
    assert LLM(str(path), dtype="float32", quantization="awq_marlin", **OPTIONS).engine.loaded.quantization == "awq"
    with pytest.raises(ParamError, match="'gptq' names a checkpoint format, and this checkpoint is not quantized"):
        LLM(str(sources["llama"]), dtype="float32", quantization="gptq", **OPTIONS)


def _edited_copy(path, dest, config=None, tensors=None):
    """A copy of the checkpoint at `path`, its quantization_config and tensors edited in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    if config is not None:
        raw = json.loads((dest / "config.json").read_text())
        config(raw["quantization_config"])
        (dest / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        for file in dest.glob("*.safetensors"):
            state = load_file(str(file))
            tensors(state)
            save_file(state, str(file), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("edit,named", [
    (dict(checkpoint_format="marlin"), "gptq checkpoint_format 'marlin' cannot be loaded"),
    (dict(checkpoint_format="bitblas"), "gptq checkpoint_format 'bitblas' cannot be loaded"),
    (dict(is_marlin_format=True), "gptq checkpoint_format 'marlin' cannot be loaded"),
    (dict(group_size=-2), "gptq: group_size -2 cannot be loaded"),
    (dict(group_size="32"), "gptq: group_size '32' cannot be loaded"),
    (dict(bits="4"), "gptq: '4' bits cannot be loaded"),
])
def test_gptq_settings_it_cannot_read_are_refused_by_name(checkpoints, tmp_path, edit, named):
    """A GPTQModel checkpoint saved in Marlin's or BitBLAS's layout keeps the tensor names and permutes
    their contents: read as GPTQ's it would load as garbage (vLLM reads it as another method)."""
    path = _edited_copy(checkpoints("gptq-4bit-g32-sym")[0], tmp_path / "edited", config=lambda c: c.update(edit))
    with pytest.raises(ParamError, match=named):
        LLM(str(path), dtype="float32", **OPTIONS)


def _int_scales(state, name):
    state[name] = state[name].to(torch.int32)


def _nan_scale(state, name):
    state[name][0, 0] = float("nan")


@pytest.mark.parametrize("name,corrupt,named", [
    ("gptq-4bit-g32-sym", _int_scales, "q_proj's 'scales' tensor is torch.int32, not floating point"),
    ("gptq-4bit-g32-sym", _nan_scale, "q_proj's 'scales' tensor holds 1 NaN or infinite values"),
    ("awq-g32", _nan_scale, "q_proj's 'scales' tensor holds 1 NaN or infinite values"),
    ("ct-w4a16-asym", _nan_scale, "q_proj's 'weight_scale' tensor holds 1 NaN or infinite values"),
])
def test_corrupt_scales_are_refused_by_name(checkpoints, tmp_path, name, corrupt, named):
    """A scale that cannot scale (not floating point, NaN) would make every weight of its group garbage."""
    scales = "weight_scale" if name.startswith("ct-") else "scales"
    path = _edited_copy(checkpoints(name)[0], tmp_path / "edited",
                        tensors=lambda state: corrupt(state, f"model.layers.0.self_attn.q_proj.{scales}"))
    with pytest.raises(ParamError, match=named):
        LLM(str(path), dtype="float32", **OPTIONS)


def test_act_order_missing_its_g_idx_is_refused_by_name(checkpoints, tmp_path):
    """desc_act's groups are g_idx's: read in order without it, the weights would be garbage."""
    path = _edited_copy(checkpoints("gptq-4bit-g128-asym-actorder")[0], tmp_path / "edited",
                        tensors=lambda state: state.pop("model.layers.1.mlp.down_proj.g_idx"))
    with pytest.raises(ParamError, match="gptq: model.layers.1.mlp.down_proj lacks its 'g_idx' tensor, which desc_act"):
        LLM(str(path), dtype="float32", **OPTIONS)


@pytest.mark.parametrize("name", ["gptq-4bit-g128-asym-actorder", "gptq-4bit-g32-sym", "awq-g32"])
def test_a_module_missing_its_packed_weights_names_them(checkpoints, tmp_path, name):
    """A module with its scales (and g_idx) but no `qweight` was refused as an 'unexpected tensor ...g_idx'
    (or its scales), which hid what was missing: the error names the module's missing `qweight`."""
    path = _edited_copy(checkpoints(name)[0], tmp_path / "edited",
                        tensors=lambda state: state.pop("model.layers.1.mlp.down_proj.qweight"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj lacks its 'qweight' tensor"):
        LLM(str(path), dtype="float32", **OPTIONS)


def test_act_order_with_one_group_per_channel_loads_without_g_idx(checkpoints, tmp_path):
    """With group_size -1 every input feature is in the one group, whatever the order it was quantized
    in: desc_act changes nothing and g_idx is not needed (vLLM reads it as no act order)."""
    original = checkpoints("gptq-4bit-channel")[0]

    def no_g_idx(state):
        for name in [n for n in state if n.endswith(".g_idx")]:
            del state[name]
    path = _edited_copy(original, tmp_path / "edited", config=lambda c: c.update(desc_act=True), tensors=no_g_idx)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = LLM(str(original), dtype="float32", **OPTIONS).generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert LLM(str(path), dtype="float32", **OPTIONS).generate(PROMPTS[:1], params)[0].outputs[0].token_ids == expected


def test_an_asymmetric_checkpoint_missing_a_zero_point_is_refused_by_name(checkpoints, tmp_path):
    """Without its zero points an asymmetric module read as symmetric would be garbage."""
    path = _edited_copy(checkpoints("ct-w4a16-asym")[0], tmp_path / "edited",
                        tensors=lambda state: state.pop("model.layers.0.mlp.down_proj.weight_zero_point"))
    with pytest.raises(ValueError, match="down_proj lacks its 'weight_zero_point' tensor"):
        LLM(str(path), dtype="float32", **OPTIONS)


@pytest.mark.parametrize("name", ["ct-w8a8", "ct-fp8-dynamic"])
def test_a_module_missing_its_scales_is_refused_not_loaded_as_plain_weights(checkpoints, tmp_path, name):
    """Without its weight_scale an int8 or FP8 `weight` looks like an unquantized module's: copied as
    a float weight it loaded as garbage."""
    path = _edited_copy(checkpoints(name)[0], tmp_path / "edited",
                        tensors=lambda state: state.pop("model.layers.0.self_attn.o_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight' is torch.(int8|float8_e4m3fn), "
                                         "quantized values without the scales"):
        LLM(str(path), dtype="float32", **OPTIONS)


def test_4bit_float_weights_are_refused_by_name(checkpoints, tmp_path):
    """NVFP4-style 4-bit float weights (packed, no `weight` tensor): the scheme named, not a missing tensor."""
    def fp4(config):
        config["config_groups"]["group_0"]["weights"].update(type="float", num_bits=4)

    path = _edited_copy(checkpoints("ct-w4a16")[0], tmp_path / "edited", config=fp4)
    with pytest.raises(ParamError, match=r"float weights of 4 bits \(packed\) cannot be loaded \(supported: FP8"):
        LLM(str(path), dtype="float32", **OPTIONS)
