"""Speculative decoding keeps the model's outputs: greedy tokens (and logprobs) equal to decoding
without it, with every proposer and family, chunked prefill, prefix-cache hits, preemption and
n > 1; sampled tokens keep the model's distribution (chi-square); nothing leaks with aborts."""
import math
import random

import pytest
import torch

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.engine.model_runner import kv_bytes_per_block
from treeserve.engine.spec_decode.proposer import PerRequestProposer
from treeserve.engine.spec_decode.step_costs import PassCosts
from treeserve.errors import ParamError
from treeserve.speculative_config import SpeculativeConfig
from treeserve.testing.tiny_models import FAMILIES

# prompts that repeat themselves (an n-gram of the prompt recurs, so drafts come from it), and the
# repetitive greedy outputs of random tiny models feed the lookup too
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8] * 3, list(range(20, 60)) + list(range(20, 40)), [3, 4] * 10,
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _llm(path, **options):
    options.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(str(path), dtype="float32", device="cpu", **options)


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [[c.token_ids for c in o.outputs] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                   use_tqdm=False)]


class ReferenceDrafts(PerRequestProposer):
    """A proposer that knows the greedy reference continuation and spoils every third draft token:
    drafts are accepted, rejected mid-way and fully accepted, so the KV of kept drafts is read by
    later steps (a test double for where drafts come from; the verification is the engine's)."""

    def __init__(self, prompts, reference):
        self.by_prompt = {tuple(p): out[0] for p, out in zip(prompts, reference)}
        self.calls = 0

    def propose(self, request, k, threshold):
        self.calls += 1
        continuation = self.by_prompt[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        draft = list(continuation[done:done + k])
        if self.calls % 3 == 0 and draft:
            draft[-1] = (draft[-1] + 1) % 64
        return draft


@pytest.fixture(scope="module")
def reference(llama_dir):
    return _tokens(_llm(llama_dir, enable_prefix_caching=False))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_equal_decoding_without_speculation(tiny_model_dirs, family, method):
    path = tiny_model_dirs[family]
    expected = _tokens(_llm(path))
    llm = _llm(path, speculative_config={"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert _tokens(llm) == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    assert stats.spec_decode_num_accepted_tokens == sum(stats.spec_decode_num_accepted_tokens_per_pos)
    assert_no_leak(llm.engine)


def _install(llm, proposer):
    """`proposer` drafts for every request that speculates with the engine's configuration."""
    speculator = llm.engine.speculator
    speculator.proposers[speculator.config] = proposer
    return llm


def _with_reference_drafts(llm, reference):
    return _install(llm, ReferenceDrafts(PROMPTS, reference))


def _spec(k=4, **options):
    return {"method": "ngram", "num_speculative_tokens": k, **options}


def test_kept_drafts_give_the_reference_tokens(llama_dir, reference):
    llm = _with_reference_drafts(_llm(llama_dir, speculative_config=_spec()), reference)
    assert _tokens(llm) == reference
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_drafts, "most drafts were kept"
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, "some were rejected"
    assert stats.num_steps < 40 * len(PROMPTS) / 2
    assert_no_leak(llm.engine)


def test_chunked_prefill_and_prefix_cache_hits_keep_the_tokens(llama_dir, reference):
    llm = _with_reference_drafts(_llm(llama_dir, max_num_batched_tokens=7, speculative_config=_spec()), reference)
    assert _tokens(llm) == reference
    hits = llm.engine.stats().prefix_hits
    assert _tokens(llm) == reference  # again: the prompts' blocks (and kept drafts' blocks) are cached
    assert llm.engine.stats().prefix_hits > hits
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_no_leak(llm.engine)


def test_preemption_keeps_the_tokens(llama_dir, reference):
    probe = _llm(llama_dir)
    per_block = kv_bytes_per_block(probe.engine.model, 16, probe.engine.dtype)
    llm = _with_reference_drafts(_llm(llama_dir, kv_cache_memory_bytes=per_block * 8, max_model_len=128,
                                      speculative_config=_spec()), reference)
    assert _tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_no_leak(llm.engine)


def test_n_greater_than_one_and_logprobs_equal_decoding_without_speculation(llama_dir, reference):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=3, logprobs=2)
    plain = _llm(llama_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = _with_reference_drafts(_llm(llama_dir, speculative_config=_spec()), reference)
    speculated = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for a, b in zip(plain, speculated):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert len(x.logprobs) == len(y.logprobs) == 40
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert ex.keys() == ey.keys()
                assert all(ex[t].rank == ey[t].rank and ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-5)
                           for t in ex)
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_no_leak(llm.engine)


def test_max_tokens_and_stop_tokens_end_inside_a_draft(llama_dir, reference):
    llm = _with_reference_drafts(_llm(llama_dir, speculative_config=_spec(k=8)), reference)
    for max_tokens in (1, 2, 5, 9):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert [t[0] for t in _tokens(llm, params=params)] == [r[0][:max_tokens] for r in reference]
    stop = reference[0][0][6]  # a token the first prompt emits at its 7th position
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[0][0][:reference[0][0].index(stop) + 1] and out.stop_reason == stop
    assert_no_leak(llm.engine)


class FixedDraft(PerRequestProposer):
    def __init__(self, token):
        self.token = token

    def propose(self, request, k, threshold):
        return [self.token][:k]


def _top3(llm, prompt):
    """The model's top-3 next tokens and their probabilities renormalized over those three (top_k=3)."""
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                       use_tqdm=False)[0].outputs[0].logprobs[0]
    weights = {t: math.exp(lp.logprob) for t, lp in out.items() if lp.rank <= 3}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


def test_sampled_tokens_keep_the_models_distribution(llama_dir):
    """20,000 draws of three tokens at temperature 1, top_k=3; the second and third come from one
    verified step whose draft for the second is a token the model gives a middling probability
    (kept when its row samples it, then a bonus token; else the row's own sample). The joint
    frequencies against p(t1) p(t2 | t1) p(t3 | t1, t2) from the model's own logprobs: a greedy
    acceptance rule fails this (checked by hand)."""
    prompt = [7, 3, 9, 4, 1, 8]
    plain = _llm(llama_dir)
    second = _top3(plain, prompt + [max(_top3(plain, prompt).items(), key=lambda kv: kv[1])[0]])
    llm = _llm(llama_dir, max_num_seqs=256, speculative_config=_spec(k=1))
    _install(llm, FixedDraft(sorted(second, key=second.get)[1]))
    assert_three_tokens_follow_the_model(plain, llm, prompt)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # both branches ran
    assert_no_leak(llm.engine)


def assert_three_tokens_follow_the_model(plain, llm, prompt) -> None:
    """20,000 draws of three tokens from `llm` (temperature 1, top_k=3) against the joint
    distribution `plain` gives them, p(t1) p(t2 | t1) p(t3 | t1, t2): a chi-square test, p > 0.01."""
    expected = {(): 1.0}
    for _ in range(3):
        expected = {seq + (t,): p * q for seq, p in expected.items()
                    for t, q in _top3(plain, prompt + list(seq)).items()}
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, n=100)
    counts = dict.fromkeys(expected, 0)
    for output in llm.generate([{"prompt_token_ids": prompt}] * 200, params, use_tqdm=False):
        for c in output.outputs:
            key = tuple(c.token_ids)
            counts[key] = counts.get(key, 0) + 1  # (a sequence outside top_k's support fails the test below)
    total = sum(counts.values())
    assert total == 20_000
    observed, wanted = _binned(counts, {c: expected.get(c, 0.0) * total for c in counts})
    statistic, p_value = _chi_square(observed, wanted)
    assert p_value > 0.01, (statistic, p_value, counts, expected)


@pytest.mark.parametrize("drafts", ["reference", "ngram"])
def test_seeded_samples_equal_those_without_speculation(llama_dir, drafts):
    """A seeded request's number for position i is keyed by (seed, i), in the sampler and in the
    verification alike: its sampled tokens (and logprobs) are those of decoding without
    speculation, with drafts kept (the reference's own samples, every third spoiled) or not."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True, seed=7, n=2, logprobs=1)
    plain = _llm(llama_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    expected = [[c.token_ids for c in o.outputs] for o in plain]
    llm = _llm(llama_dir, speculative_config=_spec(k=4, prompt_lookup_min=1))
    llm.engine.speculator.costs.keep_threshold = lambda batch: 0.02
    if drafts == "reference":
        _install(llm, ReferenceDrafts(PROMPTS, [[out[0]] for out in expected]))
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == expected
    for a, b in zip(plain, got):
        for x, y in zip(a.outputs, b.outputs):
            assert all(ex.keys() == ey.keys() for ex, ey in zip(x.logprobs, y.logprobs))
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if drafts == "reference":
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_drafts
    assert_no_leak(llm.engine)


def _chi_square(observed: list[float], expected: list[float]) -> tuple[float, float]:
    """Pearson's statistic and its p-value (the chi-square survival function is the regularized upper
    incomplete gamma function: Q(df / 2, statistic / 2))."""
    statistic = sum((o - e) ** 2 / e if e > 0 else (float("inf") if o else 0.0) for o, e in zip(observed, expected))
    df = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, p_value


def _binned(counts: dict, expected: dict, least: float = 5.0) -> tuple[list[float], list[float]]:
    """Cells expected fewer than `least` times pooled into one (chi-square's rule of thumb)."""
    small = [c for c in expected if expected[c] < least]
    cells = [c for c in expected if expected[c] >= least]
    observed, wanted = [counts[c] for c in cells], [expected[c] for c in cells]
    if small:
        observed.append(sum(counts[c] for c in small))
        wanted.append(sum(expected[c] for c in small))
    return observed, wanted


def test_no_block_leaks_after_a_thousand_speculative_requests_with_aborts(llama_dir, reference):
    llm = _with_reference_drafts(_llm(llama_dir, speculative_config=_spec(k=6)), reference)
    engine = thousand_requests_with_aborts(llm, max_tokens=30)
    assert engine.stats().spec_decode_num_accepted_tokens > 1000
    assert_no_leak(engine)


def draft_always(llm):
    """Drafts at every step, whatever rows and a drafter's own passes cost: for tests of what
    drafting does, not of when it pays (which depends on the machine's timings)."""
    price_nothing(llm.engine.speculator)
    return llm


def price_nothing(speculator) -> None:
    speculator.costs.keep_threshold = lambda batch: 0.02
    proposer = speculator.proposers.get(speculator.config)
    if proposer is not None:
        proposer.pass_costs = PassCosts()
        proposer.pass_costs.share_of = lambda token_seconds: 0.0


def thousand_requests_with_aborts(llm, max_tokens: int):
    """Ten waves of 100 greedy requests, 30 of each aborted a few steps in, drafting at every step
    whatever it costs; returns the engine once every request ended."""
    rng = random.Random(0)
    engine = draft_always(llm).engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for batch in range(10):
        ids = [f"r{batch}-{i}" for i in range(100)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, list(PROMPTS[i % len(PROMPTS)]), params)
        for _ in range(rng.randint(2, 8)):
            engine.step()
        for rid in rng.sample(ids, 30):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return engine


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp"])
def test_vllms_mtp_methods_are_named_as_not_supported_yet(method):
    """vLLM's multi-token prediction methods (`mtp` and one per family, more each release) are vLLM's
    names, not typos: "not supported by treeserve yet", where the family ones read "method must be
    one of ..." as a misspelt method would."""
    with pytest.raises(ParamError, match=f"method '{method}' \\(vLLM's multi-token prediction\\) is not supported "
                                         "by treeserve yet \\(supported: ngram, "):
        SpeculativeConfig.of({"method": method, "num_speculative_tokens": 1})
    with pytest.raises(ParamError, match="method must be one of"):
        SpeculativeConfig.of({"method": "mtp_deepseek"})


def test_speculative_config_errors_name_the_problem():
    with pytest.raises(ParamError, match="'medusa' is not supported by treeserve yet"):
        SpeculativeConfig.of({"method": "medusa"})
    with pytest.raises(ParamError, match="needs a 'model'"):
        SpeculativeConfig.of({"method": "draft_model"})
    with pytest.raises(ParamError, match="takes no 'model'"):
        SpeculativeConfig.of({"method": "ngram", "model": "x"})
    assert SpeculativeConfig.of({"model": "x"}).method == "draft_model"  # vLLM's reading of a bare model
    with pytest.raises(ParamError, match="unknown key"):
        SpeculativeConfig.of({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ParamError, match="num_speculative_tokens"):
        SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ParamError, match="needs a 'method'"):
        SpeculativeConfig.of({"num_speculative_tokens": 3})
    assert SpeculativeConfig.of({"method": "suffix"}).num_speculative_tokens == 4


@pytest.mark.parametrize("given,expected", [
    ({}, (2, 4)),
    ({"prompt_lookup_min": 5}, (5, 5)),   # as vLLM's (it errored: max 4 below min 5)
    ({"prompt_lookup_max": 1}, (1, 1)),   # (it errored: max 1 below the default min 2)
    ({"prompt_lookup_min": 1}, (1, 4)),   # (vLLM: 1 to 1; the default range stays where it does not cross)
    ({"prompt_lookup_max": 8}, (2, 8)),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 6}, (3, 6)),
])
def test_one_prompt_lookup_bound_alone_moves_the_others_default_only_where_they_would_cross(given, expected):
    config = SpeculativeConfig.of({"method": "ngram", **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected
    with pytest.raises(ParamError, match=r"prompt_lookup_max must be an integer in \[5, 64\], got 4"):
        SpeculativeConfig.of({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4})


@pytest.mark.parametrize("given,named", [
    ({"prompt_lookup_max": 0}, r"prompt_lookup_max must be an integer in \[2, 64\], got 0"),
    ({"prompt_lookup_max": -3}, r"prompt_lookup_max must be an integer in \[2, 64\], got -3"),
    ({"prompt_lookup_min": 0}, r"prompt_lookup_min must be an integer in \[1, 64\], got 0"),
])
def test_a_prompt_lookup_bound_out_of_range_is_the_one_named(given, named):
    """{"prompt_lookup_max": 0} named prompt_lookup_min, a field the config did not give."""
    with pytest.raises(ParamError, match=named):
        SpeculativeConfig.of({"method": "ngram", **given})


def test_drafts_stop_at_the_disable_batch_size(llama_dir):
    llm = _llm(llama_dir, speculative_config=_spec(disable_by_batch_size=2, prompt_lookup_min=1))
    _tokens(llm)  # four requests run together: no drafts while two or more run
    batched = llm.engine.stats().spec_decode_num_drafts
    _tokens(llm, prompts=PROMPTS[:1])
    assert llm.engine.stats().spec_decode_num_drafts > batched


def test_ngram_lookup_takes_the_longest_match_and_its_latest_continuation():
    from treeserve.engine.spec_decode.ngram_index import NgramIndex

    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    index.extend(tokens)
    assert index.propose(tokens, 2) == [7, 5]  # "2 3" followed last by 7 (the 3-gram "5 2 3" never occurred)
    assert index.propose([4, 4], 3) == []
    tokens += [7]
    index.extend(tokens)  # grows where it left off
    assert index.propose(tokens, 1) == [5]


def test_suffix_drafts_follow_the_most_frequent_continuation_while_likely_enough():
    from treeserve.engine.spec_decode.continuation_counts import ContinuationCounts, draft

    group, earlier = ContinuationCounts(1, 2), ContinuationCounts(1, 2)
    earlier.extend([5, 6, 7, 5, 6, 7, 5, 6, 8])  # after "5 6": 7 twice, 8 once
    group.extend([1, 5, 6, 7])
    assert draft([group, earlier], [5, 6], 3) == [7, 5, 6]  # counts summed over both: 7 three times, 8 once
    assert draft([group, earlier], [5, 6], 3, min_path=0.8) == []  # 3/4 < 0.8
    assert draft([earlier], [1, 6], 3) == [7, 5, 6]  # the longest n-gram "1 6" never occurred: "6" did
    assert draft([earlier], [9], 3) == []


def test_draft_pace_follows_acceptance_and_probes_when_paused():
    from treeserve.engine.spec_decode.pace import MAX_PAUSE, DraftPace

    pace = DraftPace(rate=0.9)
    assert pace.allowed(0.1, 8) == 8  # 0.9^8 = 0.43 > 0.1
    assert pace.allowed(0.5, 8) == 6  # 0.9^6 = 0.53, 0.9^7 = 0.48
    for _ in range(10):
        pace.update(4, 0)
    assert pace.rate < 0.1
    decisions = [pace.allowed(0.5, 8) for _ in range(40)]
    assert 0 < sum(decisions) <= 40 // MAX_PAUSE + 2 and set(decisions) <= {0, 1}
    assert DraftPace.starting(0.05, 0.5).allowed(0.5, 8) == 0  # a new request on a losing load starts paused


def test_step_costs_fit_the_fixed_and_per_row_parts():
    from treeserve.engine.spec_decode.step_costs import DEFAULT_THRESHOLD, StepCosts

    costs = StepCosts()
    assert costs.keep_threshold(4) == DEFAULT_THRESHOLD
    for rows in [1, 4, 16, 64] * 5:
        costs.observe(rows, 0.010 + 0.001 * rows)
    fixed, per_row = costs.fit()
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.001)
    assert costs.keep_threshold(1) == pytest.approx(0.001 / 0.011)
    assert costs.keep_threshold(64) > 0.8 > costs.keep_threshold(8)


def test_lookups_are_priced_by_their_host_time(llama_dir, reference):
    """An n-gram proposer's host time per draft token is measured; where it costs more than a step's
    token (a small model's big batch), nothing is drafted."""
    llm = _llm(llama_dir, speculative_config=_spec(prompt_lookup_min=1))
    _tokens(llm)
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.config]
    drafted = llm.engine.stats().spec_decode_num_draft_tokens
    assert drafted > 0 and proposer.pass_costs.seconds_per_token > 0
    proposer.pass_costs.seconds_per_token = 1e-3  # a millisecond of lookups per draft token...
    llm.engine.speculator.costs.token_seconds = lambda batch: 1e-4  # ...where a step's token costs a tenth of it
    assert _tokens(llm) == reference
    assert llm.engine.stats().spec_decode_num_draft_tokens == drafted
    proposer.pass_costs.seconds_per_token = 1e-6  # cheap lookups: drafting again
    llm.engine.speculator.costs.keep_threshold = lambda batch: 0.02
    _tokens(llm)
    assert llm.engine.stats().spec_decode_num_draft_tokens > drafted


def test_a_search_speculates_with_its_own_config_and_leaks_nothing(pair):
    from treeserve import Runtime
    from treeserve.search.config import SearchConfig, declared_aggregation
    from treeserve.search.runner import SearchRunner

    rt = Runtime(pair, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    gen = rt.engine("gen")
    base = dict(strategy="beam", n=4, beam_width=2, num_iterations=3, max_tokens=12, system_prompt=None, seed=3,
                agg_strategy=declared_aggregation(pair["prm"]))
    runner = SearchRunner(gen, rt.scorer("prm"))
    plain = runner.run(["Add two and three."], SearchConfig(**base))[0]
    assert gen.stats().spec_decode_num_drafts == 0  # off unless the search asks
    greedy = SearchConfig(**base, temperature=0.0, speculative_config={"method": "suffix", "prompt_lookup_min": 1})
    speculated = runner.run(["Add two and three."], greedy)[0]
    reference = runner.run(["Add two and three."], SearchConfig(**base, temperature=0.0))[0]
    assert speculated.completions == reference.completions  # greedy: the same text with or without drafts
    assert gen.stats().spec_decode_num_drafts > 0
    assert plain.completions
    with pytest.raises(ParamError, match="speculative_config"):
        SearchConfig(**base, speculative_config={"method": "medusa"})
    assert gen.kv.num_blocks_in_use() == gen.retained.num_blocks()


def test_constrained_outputs_check_drafts_against_the_grammar(llama_dir):
    """Structured outputs: drafts are cut where the grammar refuses them, each verified row is masked
    by the grammar after the drafts before it; greedy tokens equal those without speculation."""
    from treeserve.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    expected = _tokens(_llm(llama_dir), params=params)
    llm = _llm(llama_dir, speculative_config=_spec(k=6))
    drafts = ReferenceDrafts(PROMPTS, expected)
    _install(llm, drafts)
    assert _tokens(llm, params=params) == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_drafts  # whole drafts kept, masks and all
    assert_no_leak(llm.engine)
    refused = _llm(llama_dir, speculative_config=_spec(k=6))
    _install(refused, FixedDraft(0))  # a token no JSON object starts with: never drafted, never verified
    assert _tokens(refused, params=params) == expected
    assert refused.engine.stats().spec_decode_num_drafts == 0
