"""`draft_model` speculation: a second, smaller model with the target's tokenizer drafts greedily,
its KV in the target's KV space. Greedy tokens equal decoding without speculation on every family
(with a draft that agrees always, sometimes and never), with chunked prefill, prefix-cache hits,
preemption and n > 1; sampling keeps the distribution; the draft's blocks are given back."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_no_leak
from test_spec_decode import (PROMPTS, _llm, _tokens, assert_three_tokens_follow_the_model, draft_always,
                              thousand_requests_with_aborts)
from treeserve import SamplingParams
from treeserve.errors import ParamError
from treeserve.testing.tiny_models import FAMILIES, make_tiny_model


def _perturbed_copy(source, dest, scale: float, seed: int = 0):
    """The source checkpoint with noise on its MLPs' down projections: a draft that agrees with the
    target's greedy choice often, not always."""
    shutil.copytree(source, dest)
    weights = load_file(dest / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if "down_proj" in name or "experts" in name:
            weights[name] = tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _stranger(target, dest):
    """A one-layer llama with the target's tokenizer: its drafts are rarely kept."""
    from transformers import AutoTokenizer

    return make_tiny_model("llama", dest, seed=1, tokenizer=AutoTokenizer.from_pretrained(target),
                           num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)


@pytest.fixture(scope="module")
def drafts(tiny_model_dirs, tmp_path_factory):
    """A stranger to the llama target and a perturbed copy of it (most drafts kept)."""
    root = tmp_path_factory.mktemp("drafts")
    return {"stranger": _stranger(tiny_model_dirs["llama"], root / "stranger"),
            "perturbed": _perturbed_copy(tiny_model_dirs["llama"], root / "perturbed", scale=0.2)}


def _drafting(path, **options):
    """An LLM drafting with a draft model at every step, whatever it costs (draft_always)."""
    return draft_always(_llm(path, **options))


def _draft(model, k=4):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def _counts(llm):
    stats = llm.engine.stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_decoding_without_speculation(tiny_model_dirs, tmp_path, family):
    path = tiny_model_dirs[family]
    expected = _tokens(_llm(path))
    itself = _drafting(path, speculative_config=_draft(path))
    assert _tokens(itself) == expected
    drafted, accepted = _counts(itself)
    assert drafted > 0 and accepted == drafted, "the target drafting for itself: every draft token is kept"
    assert_no_leak(itself.engine)
    stranger = _drafting(path, speculative_config=_draft(_stranger(path, tmp_path / "stranger")))
    assert _tokens(stranger) == expected
    assert _counts(stranger)[0] > 0
    assert_no_leak(stranger.engine)


@pytest.fixture(scope="module")
def reference(llama_dir):
    return _tokens(_llm(llama_dir, enable_prefix_caching=False))


def _partly_kept(llm):
    drafted, accepted = _counts(llm)
    assert 0 < accepted < drafted, (drafted, accepted)


def test_a_draft_that_agrees_sometimes_keeps_the_tokens(llama_dir, drafts, reference):
    llm = _drafting(llama_dir, speculative_config=_draft(drafts["perturbed"]))
    assert _tokens(llm) == reference
    _partly_kept(llm)
    stats = llm.engine.stats()
    assert stats.num_steps < 40 * len(PROMPTS) * 0.6  # fewer target steps than tokens
    assert_no_leak(llm.engine)


def test_chunked_prefill_and_prefix_cache_hits_keep_the_tokens(llama_dir, drafts, reference):
    llm = _drafting(llama_dir, max_num_batched_tokens=7, speculative_config=_draft(drafts["perturbed"]))
    assert _tokens(llm) == reference
    hits = llm.engine.stats().prefix_hits
    assert _tokens(llm) == reference
    assert llm.engine.stats().prefix_hits > hits
    _partly_kept(llm)
    assert_no_leak(llm.engine)


def test_preemption_keeps_the_tokens(llama_dir, drafts, reference):
    """A pool of 8 blocks for 4 requests: the draft takes blocks only while the target's requests
    have room, the target preempts; the tokens are the same and nothing is left held."""
    per_block = (8 << 20) // _llm(llama_dir).engine.kv.pool.num_blocks
    llm = _drafting(llama_dir, kv_cache_memory_bytes=per_block * 8, max_model_len=128,
                    speculative_config=_draft(drafts["perturbed"]))
    assert _tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _partly_kept(llm)
    assert_no_leak(llm.engine)


def test_the_draft_kv_is_the_first_thing_reclaimed(llama_dir, drafts, reference):
    """When the scheduler runs short it reclaims (engine.reclaim_one): the draft's blocks go first,
    and the requests go on to the same tokens (their drafts' KV made again)."""
    llm = _drafting(llama_dir, speculative_config=_draft(drafts["perturbed"]))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", list(prompt), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    outputs, reclaimed = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        if engine.kv.pool.num_in_use_by(_owner(engine)):
            assert engine.reclaim_one()
            assert engine.kv.pool.num_in_use_by(_owner(engine)) == 0
            reclaimed += 1
    assert [[outputs[f"r{i}"]] for i in range(len(PROMPTS))] == reference
    assert reclaimed > 3
    _partly_kept(llm)
    assert_no_leak(engine)


def _owner(engine):
    return next(iter(engine.speculator.proposers.values())).owner


def test_n_greater_than_one_and_logprobs_equal_decoding_without_speculation(llama_dir, drafts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=3, logprobs=2)
    plain = _llm(llama_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = _drafting(llama_dir, speculative_config=_draft(drafts["perturbed"]))
    speculated = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for a, b in zip(plain, speculated):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert ex.keys() == ey.keys()
                assert all(ex[t].rank == ey[t].rank and ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-5)
                           for t in ex)
    _partly_kept(llm)
    assert_no_leak(llm.engine)


def test_sampled_tokens_keep_the_models_distribution(llama_dir):
    """20,000 draws of three tokens at temperature 1, top_k=3, the target drafting for itself (its
    greedy token: kept when its row samples it): the joint frequencies against the model's own
    p(t1) p(t2 | t1) p(t3 | t1, t2)."""
    llm = _drafting(llama_dir, max_num_seqs=256, speculative_config=_draft(llama_dir, k=2))
    assert_three_tokens_follow_the_model(_llm(llama_dir), llm, [7, 3, 9, 4, 1, 8])
    _partly_kept(llm)
    assert_no_leak(llm.engine)


def test_no_block_leaks_after_a_thousand_requests_with_aborts(llama_dir, drafts):
    llm = _drafting(llama_dir, speculative_config=_draft(drafts["perturbed"], k=6))
    engine = thousand_requests_with_aborts(llm, max_tokens=20)
    _partly_kept(llm)
    assert not next(iter(engine.speculator.proposers.values())).sequences
    assert_no_leak(engine)


def test_draft_model_errors_name_the_problem(llama_dir, drafts, tmp_path):
    other = make_tiny_model("llama", tmp_path / "other-tokenizer", seed=2, tokenizer_vocab_size=300)
    with pytest.raises(ParamError, match="another tokenizer"):
        _llm(llama_dir, speculative_config=_draft(other))
    with pytest.raises((ParamError, FileNotFoundError, OSError), match="no-such-draft"):
        _llm(llama_dir, speculative_config=_draft(tmp_path / "no-such-draft"))
    plain = _llm(llama_dir)
    with pytest.raises(ParamError, match="may not load a model"):  # a request cannot make the server load one
        plain.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2),
                                 speculative_config=_draft(drafts["perturbed"]))


def test_a_draft_without_weights_is_refused_at_start(llama_dir, tmp_path):
    """Its weights load at the first draft; a folder without them (config and tokenizer only) is said
    at start, as vLLM says it, not by the first request that drafts."""
    import shutil

    draft = tmp_path / "no-weights"
    shutil.copytree(llama_dir, draft)
    for weights in draft.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ParamError, match=r"speculative_config: the draft model '.*no-weights' cannot be loaded: "
                                         r".*model.safetensors: file not found"):
        _llm(llama_dir, speculative_config=_draft(draft))


def test_a_runtime_shares_its_kv_space_with_the_draft(pair):
    """A generator with a draft model in a Runtime beside its PRM: the draft's blocks come from the
    shared pool (as their own owner), a greedy search's text is that without speculation, and the
    PRM engine never loads the draft's weights."""
    from treeserve import Runtime
    from treeserve.search.config import SearchConfig, declared_aggregation
    from treeserve.search.runner import SearchRunner

    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    base = dict(strategy="beam", n=4, beam_width=2, num_iterations=3, max_tokens=12, system_prompt=None, seed=3,
                agg_strategy=declared_aggregation(pair["prm"]), temperature=0.0)
    plain_rt = Runtime(pair, **options)
    expected = SearchRunner(plain_rt.engine("gen"), plain_rt.scorer("prm")).run(["Add two and three."],
                                                                              SearchConfig(**base))[0]
    rt = Runtime(pair, speculative_config=_draft(pair["gen"]), **options)
    gen = rt.engine("gen")
    seen = []
    gen.speculator.observe_step = lambda rows, seconds: seen.append(gen.kv.pool.num_in_use_by("gen:draft"))
    speculated = SearchConfig(**base, speculative_config=_draft(pair["gen"]))  # (a search asks for it)
    got = SearchRunner(gen, rt.scorer("prm")).run(["Add two and three."], speculated)[0]
    assert got.completions == expected.completions
    assert gen.stats().spec_decode_num_accepted_tokens > 0 and max(seen) > 0
    assert gen.kv.pool is rt.engine("prm").kv.pool
    assert all(p.model is None for p in rt.engine("prm").speculator.proposers.values())  # weights: never loaded
    assert gen.kv.num_blocks_in_use() == gen.retained.num_blocks()
    assert gen.kv.pool.num_in_use_by("gen:draft") == 0
