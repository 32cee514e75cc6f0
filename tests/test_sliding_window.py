"""KV blocks behind the window go back to the pool on a model whose every layer has a sliding window
(Mistral here): a 4,096-token conversation holds at most the window plus one block of KV, in a
pool far smaller than the conversation; tokens and logprobs stay HF's with blocks freed under
chunked prefill, decode and a prefix-cache hit over freed-but-cached blocks; a model with global
layers (Gemma 2) frees nothing."""
import pytest
import torch

from conftest import assert_no_leak
from test_hf_parity import _hf_greedy, _hf_logits, _hf_model
from treeserve import LLM, SamplingParams
from treeserve.engine.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from treeserve.engine.request import Request
from treeserve.testing.tiny_models import make_tiny_model

WINDOW, BLOCK = 32, 16


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_tiny_model("mistral", tmp_path_factory.mktemp("window") / "mistral", seed=7, sliding_window=WINDOW,
                           max_position_embeddings=8192)


def _held_tokens_per_step(llm, request_id, prompt, params):
    """Runs one request to the end; the KV tokens its table held after each step."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params)
    held, output = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            output = out if out.finished else output
        if f"{request_id}#0" in engine.kv.block_tables:  # the group's one sequence
            held.append(len(engine.kv.live_blocks(f"{request_id}#0")) * engine.kv.block_size)
    return held, output


def test_a_4096_token_conversation_holds_the_window_and_one_block(mistral_dir):
    """1,000 prompt tokens in 64-token chunks, then 3,096 generated, in a pool of 512 tokens (512
    bytes each: 2 layers x K and V x 2 heads x 16 floats): at most window + one block of KV (48
    tokens) held after every step."""
    llm = LLM(str(mistral_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=512 * 512,
              max_num_batched_tokens=64, max_model_len=4096)
    assert llm.engine.kv.window == WINDOW and llm.engine.kv.block_size == BLOCK
    assert llm.engine.kv.pool.num_blocks * BLOCK < 4096
    prompt = torch.randint(10, 500, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3096, ignore_eos=True)
    held, output = _held_tokens_per_step(llm, "long", prompt, params)
    decode_held = held[-(len(output.outputs[0].token_ids) - 1):]
    print(f"\n4,096-token conversation, window {WINDOW}, blocks of {BLOCK}: KV held at most {max(decode_held)} tokens "
          f"per layer after each decode step ({max(held)} after any step, prefill chunks of 64 included), bound "
          f"window + one block = {WINDOW + BLOCK}; pool {llm.engine.kv.pool.num_blocks * BLOCK} tokens")
    assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 4096
    assert max(held) <= WINDOW + BLOCK
    assert_no_leak(llm.engine)


def test_tokens_and_logprobs_match_hf_with_blocks_freed_and_a_prefix_hit(mistral_dir):
    hf = _hf_model(mistral_dir, "cpu")
    llm = LLM(str(mistral_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=BLOCK, enable_prefix_caching=True)
    prompt = torch.randint(10, 500, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=96, min_tokens=96, logprobs=1)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 96  # blocks freed behind the window, still cached
    tokens = first.outputs[0].token_ids
    assert again.outputs[0].token_ids == tokens == _hf_greedy(hf, prompt, 96)
    ref = torch.log_softmax(_hf_logits(hf, prompt + tokens), dim=-1)
    for step, (token, entry) in enumerate(zip(tokens, first.outputs[0].logprobs)):
        assert abs(entry[token].logprob - float(ref[len(prompt) - 1 + step][token])) < 1e-4
    assert_no_leak(llm.engine)


def test_the_manager_frees_only_blocks_behind_every_window():
    kv = KVCacheManager(num_blocks=12, block_size=4, window=6)
    request = Request("r", list(range(30)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, 8)
    request.num_computed_tokens = 8
    kv.cache_full_blocks(request)
    kv.free_behind_window(request)  # next query at 8 sees keys 3..8: block 0 (keys 0-3) still read
    assert len(kv.live_blocks("r")) == 2
    assert kv.allocate_slots(request, 4)
    request.num_computed_tokens = 12
    kv.cache_full_blocks(request)
    kv.free_behind_window(request)  # keys 7..12: blocks 0 (0-3) and ... block 1 (4-7) still holds key 7
    assert kv.block_ids(request)[0] == NULL_BLOCK_ID and len(kv.live_blocks("r")) == 2
    child = Request("c", list(range(30)), SamplingParams(max_tokens=1))
    kv.fork(request, child)
    assert kv.pool.num_free == 12 - 2
    kv.free(request)
    kv.free(child)
    assert kv.pool.num_free == 12 and all(b.ref_count == 0 for b in kv.pool.blocks)


def test_a_model_with_global_layers_frees_nothing(tmp_path):
    path = make_tiny_model("gemma2", tmp_path / "gemma2", seed=3)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    assert llm.engine.kv.window is None
    prompt = torch.randint(10, 500, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    held, _ = _held_tokens_per_step(llm, "g", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert held[-1] >= 80
