"""The rotary + K/V write launch (`kernels/rotary_kv.py`) against the pair it replaces on the Triton
path, `fused_ops.rotary_` then `kv_write.write_kv`: q and the cache must hold the same bytes
(padded slots write nothing, GQA groups, head sizes that are no power of two, blocks of 15, 16 and
32 tokens). A model on the Triton backend gives the same logits with the fusion on and off.
Without CUDA the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1), which
has no bfloat16: those cases run on a device (benchmarks/gpu.py's CUDA test list)."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from treeserve import LLM, SamplingParams  # noqa: E402
from treeserve.model import cpu_kernels  # noqa: E402
from treeserve.model.hf_config import RopeConfig  # noqa: E402
from treeserve.model.kernels import fused_ops, kv_write, rotary_kv  # noqa: E402
from treeserve.model.layers import RotaryEmbedding  # noqa: E402
from treeserve.testing.tiny_models import make_tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def layer_inputs(tokens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """q, k, v as views into one projection output (as the attention layer splits it), and a
    [num_blocks, 2, block_size, Hkv, D] cache view into pages with room to spare (the KV arena's)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype).to(DEVICE)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    block_elems = 2 * block_size * kv_heads * head_dim
    pages = torch.randn(6, block_elems + 24, generator=generator).to(dtype).to(DEVICE)
    cache = pages[:, :block_elems].view(6, 2, block_size, kv_heads, head_dim)
    return qkv, q, k, v, cache


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (a float compare would call -0.0 and 0.0 equal)."""
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return t.contiguous().view(ints[t.dtype]).cpu()


def run_both(heads, kv_heads, head_dim, block_size, dtype, slots, positions, rope=RopeConfig(theta=10000.0)):
    """(fused, apart): each (qkv, cache) after the fused launch and after rotary_ then write_kv."""
    rotary = RotaryEmbedding(rope, head_dim, 300).to(DEVICE)
    slots = torch.tensor(slots, device=DEVICE)
    positions = torch.tensor(positions, device=DEVICE)
    results = []
    for fused in (True, False):
        qkv, q, k, v, cache = layer_inputs(len(slots), heads, kv_heads, head_dim, block_size, dtype, seed=3)
        if fused:
            rotary_kv.rotary_write_kv(q, k, v, cache[:, 0], cache[:, 1], slots, positions, rotary.cos, rotary.sin)
        else:
            fused_ops.rotary_(q, k, positions, rotary.cos, rotary.sin)
            kv_write.write_kv(k, v, cache[:, 0], cache[:, 1], slots)
        results.append((qkv, q, cache))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (4, 2, 64, 16),   # GQA 2
    (3, 1, 80, 15),   # GQA 3, head 80 (its half, 40, no power of two), blocks of 15
    (8, 8, 32, 32),   # no grouping
    (6, 2, 24, 16),   # Qwen3's tiny head of 24 (half 12)
])
def test_fused_rotary_kv_equals_rotary_then_write(dtype, heads, kv_heads, head_dim, block_size):
    slots = [3, block_size * 4 + block_size - 1, -1, block_size * 2, block_size + 1]
    positions = [0, 299, 7, 100, 64]
    (qkv, q, cache), (qkv_apart, q_apart, cache_apart) = run_both(heads, kv_heads, head_dim, block_size, dtype,
                                                                    slots, positions)
    assert torch.equal(as_bits(q), as_bits(q_apart))            # rotated in place, every row (a padded one too)
    assert torch.equal(as_bits(cache), as_bits(cache_apart))    # rotated keys and values, nothing at slot -1
    kv = qkv[:, heads * head_dim:]
    untouched = layer_inputs(len(slots), heads, kv_heads, head_dim, block_size, dtype, seed=3)[0][:, heads * head_dim:]
    assert torch.equal(as_bits(kv), as_bits(untouched))         # k and v as they came (the cache has the rotation)


def test_a_padded_batch_writes_no_block_but_rotates_every_query():
    """A CUDA graph's padded rows (slot -1, a stale position): the cache is untouched, q is rotated."""
    (qkv, q, cache), (_, q_apart, _) = run_both(4, 2, 32, 16, torch.float32, [-1, -1, -1], [5, 0, 5])
    untouched_qkv, *_, untouched_cache = layer_inputs(3, 4, 2, 32, 16, torch.float32, seed=3)
    assert torch.equal(cache, untouched_cache)
    assert torch.equal(q, q_apart) and not torch.equal(q[0], untouched_qkv[0, :4 * 32].view(4, 32))
    assert torch.equal(q[1], untouched_qkv[1, :4 * 32].view(4, 32))  # position 0: the identity rotation


def test_longrope_rows_past_the_tables_first_half():
    """LongRoPE's tables stack short then long factors: the runner's positions index either half."""
    rope = RopeConfig(theta=10000.0, rope_type="longrope", short_factor=(1.0,) * 16, long_factor=(4.0,) * 16,
                      original_max_position_embeddings=64)
    (_, q, cache), (_, q_apart, cache_apart) = run_both(4, 2, 32, 16, torch.float32, [0, 17, 40],
                                                        [3, 300 + 70, 599], rope=rope)
    assert torch.equal(q, q_apart) and torch.equal(cache, cache_apart)


# q and the cache hold the same bytes either way, so the logits are the same bits (bfloat16: on a device)
MODEL_CASES = [("llama", "float32"), ("qwen3", "float32"), ("gemma3", "float32")] + \
    ([("llama", "bfloat16"), ("qwen3", "bfloat16")] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("family, dtype", MODEL_CASES)
def test_triton_backend_logits_are_the_same_with_the_fusion_on_and_off(tmp_path, monkeypatch, family, dtype):
    """The model through the Triton backend, with rotary in the K/V write's launch and with the
    layers rotating (qwen3: q/k norms before the rotation; gemma3: local RoPE tables on its
    sliding-window layers): the prompt logits, greedy tokens and their logprobs are the same bits.
    (On CPU the layers' rotary would be treeserve's C kernel, which gcc may contract into fused
    multiply-adds: a last-bit difference. PyTorch's ops round as the Triton rotary does; on CUDA
    the layers' rotary is `fused_ops.rotary_`.)"""
    monkeypatch.setattr(cpu_kernels, "library_for", lambda x: None)
    path = make_tiny_model(family, tmp_path / family, seed=2)
    llm = LLM(str(path), dtype=dtype, device=DEVICE, kv_cache_memory_bytes=4 << 20,
              attention_backend="triton", enforce_eager=True, enable_prefix_caching=False)
    backend = llm.engine.model.backend
    assert backend.fuses_rotary
    engine, prompts = llm.engine, ["The water is cold and the sky is grey", "x", "Step 1: add"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)

    def run():
        """Each prompt's logits (a prefill) and its greedy completion's logprobs (decode steps)."""
        ids = llm.get_tokenizer().encode(prompts[0])
        engine.add_request(f"logits-{backend.fuses_rotary}", ids, SamplingParams(),
                           logits_positions=list(range(len(ids))))
        logits = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    logits = torch.stack([out.prompt_logits[p].cpu() for p in range(len(ids))])
        completions = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        logprobs = torch.tensor([[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)] for c in completions])
        return logits, [c.token_ids for c in completions], logprobs

    fused = run()
    backend.fuses_rotary = False
    apart = run()
    assert torch.equal(fused[0], apart[0])
    assert fused[1] == apart[1]
    assert torch.equal(fused[2], apart[2])
