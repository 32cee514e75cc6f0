"""Quantized weights with tensor parallelism: two ranks on CPU (gloo) against one rank.

Every checkpoint format (GPTQ 4-bit in act order, GPTQ 8-bit asymmetric, AWQ, compressed-tensors
W4A16, W8A16, W8A8 and FP8 with dynamic activations) is decoded whole on each rank and sliced
(model/sharding.py): over 32 greedy float32 tokens, with chunked prefill and a prefix-cache hit, two
ranks give one rank's tokens and logprobs (within 1e-4) and, where the weights alone are quantized,
HF transformers' tokens on the same weights (the references of tests/test_quantized_checkpoints.py).
Where a scale is taken over a row-parallel projection's inputs (W8A8's and FP8's per-token
activation scales, on-the-fly int8's channel scales), it is taken over the whole row, every rank's
share (an all-reduce of the maxima at run time; the whole checkpoint row at load), so the scales are
one rank's: int8's tokens and logprobs are one rank's as closely as the weight-only schemes', and
where activations are quantized at run time the ranks' float32 partial sums can still move one
activation across a rounding step, so there logprobs stay within `ACTIVATION_BOUND` and the tokens
part only at a near tie (`ACTIVATION_TIE`); per-rank scales (vLLM's ranks take them so) measured
0.25 there. One `Runtime` serves every checkpoint over one pair of ranks (a
rank's start is most of the cost); on-the-fly int8 runs in an engine of its own. The slices
themselves are checked without processes: each rank's product from its slice adds up (row-parallel)
or joins (column-parallel) to the whole weight's, the bfloat16 kernels run the slices, and a cut
between groups, a quantized lm_head and a quantized MoE are refused by name.
"""
import pytest
import torch
import transformers
from torch import nn

from quantized_checkpoints import make_awq, make_compressed_tensors, make_gptq
from test_hf_parity import PROMPTS, _hf_greedy
from treeserve import LLM, Runtime, SamplingParams
from treeserve.errors import ParamError
from treeserve.model.hf_config import load_model_config
from treeserve.model.loader import build_model
from treeserve.model.parallel import ShardPlan, TensorParallel
from treeserve.model.quantization import Int8Linear, quantized_layer
from treeserve.model.quantization.int4 import Int4Linear
from treeserve.model.quantization.int4_csrc import CsrcInt4Linear
from treeserve.model.quantization.weights import FloatWeight, IntWeight
from treeserve.model.random_models import make_tiny_model
from treeserve.model.sharding import shard_quantized

MAX_TOKENS = 32
OPTIONS = dict(dtype="float32", device="cpu", max_num_batched_tokens=16)  # prompts longer than a chunk
TP2 = dict(tensor_parallel_size=2, threads_per_rank=1)
RUN_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[7]]  # 4, ~20 and ~30 tokens
# MLP rows 256: each rank's 128 down_proj inputs hold whole groups (of the default 160, 80 would not)
SHAPE = dict(intermediate_size=256)
CHECKPOINTS = {  # name: (family, how it is made)
    "gptq-4bit-g32-actorder": ("llama", dict(kind="gptq", bits=4, group_size=32, desc_act=True)),
    "gptq-8bit-g32-asym": ("qwen2", dict(kind="gptq", bits=8, group_size=32, sym=False)),
    "awq-g32": ("llama", dict(kind="awq", group_size=32)),
    "ct-w4a16": ("llama", dict(kind="ct", preset="W4A16")),
    "ct-w8a16": ("qwen2", dict(kind="ct", preset="W8A16")),
    "ct-w8a8": ("llama", dict(kind="ct", preset="W8A8")),
    "ct-fp8-dynamic": ("qwen2", dict(kind="ct", preset="FP8_DYNAMIC")),
}
ACTIVATIONS_QUANTIZED = ("ct-w8a8", "ct-fp8-dynamic")
INT8 = ("int8", "int8-tied")  # made on the fly: an untied head and a tied one
ACTIVATION_BOUND = 0.05
ACTIVATION_TIE = 0.05


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint, the directory HF loads as its reference, or None)."""
    pytest.importorskip("compressed_tensors", reason="the test extra's compressed-tensors is not installed")
    root = tmp_path_factory.mktemp("tp-quantized")
    sources = {f: make_tiny_model(f, root / f, seed=3, **SHAPE) for f in ("llama", "qwen2")}
    made = {"int8": (sources["llama"], None), "int8-tied": (sources["qwen2"], None)}  # qwen2's head is tied
    for name, (family, recipe) in CHECKPOINTS.items():
        recipe = dict(recipe)
        kind, source, dest, ref = recipe.pop("kind"), sources[family], root / name, root / f"{name}-ref"
        if kind == "gptq":
            made[name] = make_gptq(source, dest, ref, **recipe), ref
        elif kind == "awq":
            made[name] = make_awq(source, dest, ref, **recipe), ref
        else:  # HF loads these itself (its compressed-tensors integration)
            made[name] = make_compressed_tensors(source, dest, **recipe), dest
    return made


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5)


def _twice(generate) -> tuple[list, list]:
    """The prompts twice: the second run hits the prefix cache."""
    return generate(RUN_PROMPTS, _params()), generate(RUN_PROMPTS, _params())


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    """name -> outputs of two ranks: every checkpoint in one Runtime, int8 in engines of its own."""
    paths = {name: str(path) for name, (path, _) in checkpoints.items() if name not in INT8}
    runtime = Runtime(paths, kv_cache_memory_bytes=32 << 20, **OPTIONS, **TP2)
    try:
        outputs = {name: _twice(lambda p, s: runtime.generate(name, p, s)) for name in paths}
    finally:
        runtime.close()
    for name in INT8:
        with LLM(str(checkpoints[name][0]), quantization="int8", kv_cache_memory_bytes=8 << 20, **OPTIONS, **TP2) as llm:
            outputs[name] = _twice(lambda p, s: llm.generate(p, s, use_tqdm=False))
            # each layer's four projections and this rank's vocabulary rows of the LM head (a tied one's:
            # the vocabulary-parallel embedding keeps its rows, dequantized, as one rank's lookups read them)
            model = llm.engine.model
            assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * len(model.layers) + 1
            assert isinstance(model.lm_head, Int8Linear)
    return outputs


def _one_rank(path, name: str) -> list:
    extra = dict(quantization="int8") if name in INT8 else {}
    with LLM(str(path), kv_cache_memory_bytes=8 << 20, **OPTIONS, **extra) as llm:
        return llm.generate(RUN_PROMPTS, _params(), use_tqdm=False)


def _first_parting(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _assert_alike(ours, ref, bound: float, tie: float) -> None:
    """Tokens equal up to a parting where `ref`'s logprobs of both tokens lie within `tie`, logprobs
    within `bound` up to there."""
    for x, y in zip(ours, ref, strict=True):
        a, b = x.outputs[0], y.outputs[0]
        part = _first_parting(a.token_ids, b.token_ids)
        assert part is None or tie > 0, (x.prompt, part, a.token_ids, b.token_ids)
        for ours_step, ref_step in zip(a.logprobs[:None if part is None else part + 1], b.logprobs):
            errors = [abs(ours_step[t].logprob - ref_step[t].logprob) for t in ref_step if t in ours_step]
            assert errors and max(errors) < bound, (x.prompt, errors)
        if part is not None:
            ref_step = b.logprobs[part]
            chosen, theirs = ref_step[b.token_ids[part]].logprob, ref_step.get(a.token_ids[part])
            assert theirs is not None and chosen - theirs.logprob < tie, (x.prompt, part, chosen, theirs)


@pytest.mark.parametrize("name", list(CHECKPOINTS) + list(INT8))
def test_two_ranks_give_one_ranks_tokens(checkpoints, two_ranks, name):
    path, reference = checkpoints[name]
    ref, (first, cached) = _one_rank(path, name), two_ranks[name]
    assert all(o.num_cached_tokens > 0 for o in cached[1:])  # the prompts longer than a block
    for ours in (first, cached):
        if name in ACTIVATIONS_QUANTIZED:
            _assert_alike(ours, ref, ACTIVATION_BOUND, ACTIVATION_TIE)
        else:
            _assert_alike(ours, ref, 1e-4, 0.0)
    # HF holds no on-the-fly int8; W8A8 and FP8 against HF: tests/test_quantized_checkpoints.py
    if name in INT8 or name in ACTIVATIONS_QUANTIZED:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    for output in first:
        assert output.outputs[0].token_ids == _hf_greedy(hf, output.prompt_token_ids, MAX_TOKENS), output.prompt


def _plan(rank: int, intermediate_size: int = 256) -> ShardPlan:
    return ShardPlan.check(TensorParallel(rank, 2), num_heads=4, num_kv_heads=2, head_dim=16,
                           intermediate_size=intermediate_size, vocab_size=512)


def _int_weight(out_features: int, in_features: int, group_size: int, act_order: bool = False) -> IntWeight:
    groups = in_features // group_size
    values = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    g_idx = torch.randperm(in_features) // group_size if act_order else None
    return IntWeight(values, torch.rand(out_features, groups) * 0.02 + 0.01,
                     torch.randint(1, 16, (out_features, groups)).float(), 4, group_size, g_idx)


WEIGHTS = {  # down_proj-shaped: 64 outputs from the MLP's 256 rows
    "groups": lambda: _int_weight(64, 256, 32),
    "act-order": lambda: _int_weight(64, 256, 32, act_order=True),
    "per-channel": lambda: _int_weight(64, 256, 256),
    "fp8": lambda: FloatWeight(torch.randn(64, 256), "fp8_token"),
}


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_each_ranks_slice_multiplies_as_its_part_of_the_whole(kind):
    """Row-parallel (down_proj): the ranks' products from their input features add up to the whole
    weight's; column-parallel (gate, up): their output channels join to it."""
    torch.manual_seed(0)
    weight, x = WEIGHTS[kind](), torch.randn(3, 256)
    whole = x @ weight.dequantize().t()
    down = [shard_quantized("layers.0.mlp.down_proj.weight", None, weight, _plan(r)) for r in (0, 1)]
    summed = sum(x[:, 128 * r:128 * (r + 1)] @ down[r].dequantize().t() for r in (0, 1))
    assert torch.allclose(summed, whole, atol=1e-5)
    gate = [shard_quantized("layers.0.mlp.gate_up_proj.weight", 0, weight, _plan(r, 64)) for r in (0, 1)]
    assert torch.allclose(torch.cat([x @ part.dequantize().t() for part in gate], dim=1), whole, atol=1e-5)


@pytest.mark.parametrize("kind", ["groups", "act-order", "per-channel"])
def test_bfloat16_runs_the_int4_kernels_on_the_slices(kind):
    """Output channels keep every group (act order too); input features keep whole groups, except in
    act order, where a group's features lie on both ranks and the slice runs dequantized."""
    torch.manual_seed(0)
    weight = WEIGHTS[kind]()
    rows = shard_quantized("layers.0.mlp.gate_up_proj.weight", 1, weight, _plan(1, 64))
    columns = shard_quantized("layers.0.mlp.down_proj.weight", None, weight, _plan(1))
    for part, kernel in ((rows, True), (columns, kind != "act-order")):
        layer = quantized_layer(part, None, torch.bfloat16)
        assert isinstance(layer, (CsrcInt4Linear, Int4Linear)) == kernel, (part.shape, type(layer))
        assert kernel or type(layer) is nn.Linear
        x = torch.randn(5, part.shape[1], dtype=torch.bfloat16)
        ref = x.float() @ part.dequantize().t()
        assert torch.allclose(layer(x).float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_a_row_parallel_cut_between_groups_is_refused_by_name(tmp_path):
    """The default tiny MLP's 160 rows give each rank 80 of down_proj's inputs: not whole groups of 32."""
    source = make_tiny_model("llama", tmp_path / "llama", seed=3)
    path = make_gptq(source, tmp_path / "gptq", tmp_path / "ref", bits=4, group_size=32)
    expected = (r"2 ranks split layers.0.mlp.down_proj's 160 input features into shards of 80, and input features "
                r"\[0, 80\) do not fall on its groups of 32")
    with pytest.raises(ParamError, match=expected) as caught:
        LLM(str(path), kv_cache_memory_bytes=8 << 20, **OPTIONS, **TP2)
    assert caught.value.param == "tensor_parallel_size"


def test_a_quantized_lm_head_is_refused_with_tensor_parallelism():
    with pytest.raises(ParamError, match="a quantized lm_head cannot be sharded"):
        shard_quantized("lm_head.weight", None, _int_weight(512, 64, 32), _plan(0))


def test_a_quantized_moe_is_refused_with_tensor_parallelism(tmp_path):
    """Before any weight is read, or any collective waited on."""
    source = make_tiny_model("mixtral", tmp_path / "mixtral", seed=3)
    path = make_gptq(source, tmp_path / "gptq", tmp_path / "ref", bits=4, group_size=32)
    with pytest.raises(ParamError, match="tensor parallelism does not shard mixture-of-experts layers"):
        build_model(path, load_model_config(path), torch.float32, torch.device("cpu"), 64, tp=TensorParallel(0, 2),
                    quantization="gptq")
