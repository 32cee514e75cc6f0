"""vLLM's bad_words, allowed_token_ids, truncate_prompt_tokens and detokenize in the offline API:
greedy tokens as HF's `bad_words_ids` / `prefix_allowed_tokens_fn` give them, with n > 1, async
scheduling and the prefix cache; clear errors naming the field; nothing done for requests that use
none of them."""
import pytest
import torch
import transformers

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.engine import sampler as sampler_module
from treeserve.engine.spec_decode.proposer import PerRequestProposer
from treeserve.engine.token_masks import bad_word_sequences, banned_tokens
from treeserve.errors import ParamError

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
PROMPTS = ["The water is", "Once upon a time there was a little", "1 + 2 ="]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), **OPTIONS)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, **fields)


def _hf_greedy(hf, ids, **constraints) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          pad_token_id=hf.config.pad_token_id, **constraints)
    return out[0, len(ids):].tolist()


def test_vllms_fields_are_taken_and_bad_values_named():
    params = SamplingParams(bad_words=["foo", "foo"], allowed_token_ids=(3, 4), truncate_prompt_tokens=-1,
                            detokenize=False)
    assert params.bad_words == ["foo"] and params.allowed_token_ids == [3, 4]
    assert params.clone().truncate_prompt_tokens == -1
    bad = [("allowed_token_ids", {"allowed_token_ids": []}), ("allowed_token_ids", {"allowed_token_ids": [-1]}),
           ("allowed_token_ids", {"allowed_token_ids": ["3"]}),
           ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
           ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
           ("bad_words", {"bad_words": [""]}), ("bad_words", {"bad_words": "foo"}),
           ("detokenize", {"detokenize": "no"}), ("stop", {"detokenize": False, "stop": ["x"]})]
    for name, fields in bad:
        with pytest.raises(ParamError) as error:
            SamplingParams(**fields)
        assert error.value.param == name, fields


def test_the_models_checks_name_the_field(llm):
    vocab = llm.engine.loaded.model_config.vocab_size
    cases = [("allowed_token_ids", SamplingParams(allowed_token_ids=[1, vocab])),
             ("truncate_prompt_tokens", SamplingParams(truncate_prompt_tokens=OPTIONS["max_model_len"] + 1))]
    for name, params in cases:
        with pytest.raises(ValueError, match=name) as error:
            llm.generate("Hello", params, use_tqdm=False)
        assert error.value.param == name
    assert_no_leak(llm.engine)


def test_bad_words_are_each_words_tokens_alone_and_after_a_space(llm):
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.loaded.model_config.vocab_size
    alone, spaced = (tokenizer.encode(t, add_special_tokens=False) for t in ("water", " water"))
    assert alone != spaced  # (the tiny tokenizer writes them differently: both are banned)
    sequences = bad_word_sequences(tokenizer, ["water"], vocab)
    assert list(map(list, sequences)) == [alone, spaced] if len(alone) == len(spaced) else [alone]
    assert banned_tokens([], ((7,), (5, 6))) == [7]                  # a one-token word: always
    assert banned_tokens([1, 5], ((7,), (5, 6))) == [7, 6]           # its prefix ends the output
    assert banned_tokens([5, 1], ((5, 6),)) == [] and banned_tokens([], ((5, 6),)) == []


def test_allowed_token_ids_match_hfs_prefix_allowed_tokens_fn(llm, hf):
    tokenizer = llm.get_tokenizer()
    allowed = sorted({t for p in PROMPTS for t in tokenizer.encode(p, add_special_tokens=False)})
    outputs = llm.generate(PROMPTS, _greedy(allowed_token_ids=allowed), use_tqdm=False)
    for output in outputs:
        tokens = output.outputs[0].token_ids
        assert set(tokens) <= set(allowed)
        assert tokens == _hf_greedy(hf, output.prompt_token_ids, prefix_allowed_tokens_fn=lambda _, __: allowed)
    assert_no_leak(llm.engine)


def test_an_allowed_set_that_leaves_nothing_to_sample_is_named(llm):
    """allowed_token_ids all stop tokens with min_tokens still to reach, or all one-token bad words:
    every logit of the row is -inf, and a token outside the set came out (0 greedy, the last id sampled)."""
    tokenizer = llm.get_tokenizer()
    eos = list(llm.engine.loaded.eos_token_ids)
    [word] = [w for w in ("water", "the", "is") if len(tokenizer.encode(w, add_special_tokens=False)) == 1][:1]
    [token] = tokenizer.encode(word, add_special_tokens=False)
    nothing_left = [dict(allowed_token_ids=eos, min_tokens=3), dict(allowed_token_ids=[token], bad_words=[word]),
                    dict(allowed_token_ids=[token, 7], stop_token_ids=[7], bad_words=[word], min_tokens=1)]
    for fields in nothing_left:
        for temperature in (0, 1.0):
            with pytest.raises(ValueError, match="nothing could be sampled") as error:
                llm.generate("The water is", SamplingParams(temperature=temperature, max_tokens=6, **fields),
                             use_tqdm=False)
            assert error.value.param == "allowed_token_ids", fields
    # the same sets leave a token where nothing else masks it: only allowed tokens come out
    [stops] = llm.generate("The water is", SamplingParams(max_tokens=6, allowed_token_ids=eos), use_tqdm=False)
    assert stops.outputs[0].token_ids == eos[:1] and stops.outputs[0].finish_reason == "stop"
    [ignored] = llm.generate("The water is", SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True,
                                                            allowed_token_ids=eos), use_tqdm=False)
    assert set(ignored.outputs[0].token_ids) <= set(eos) and len(ignored.outputs[0].token_ids) == 4
    assert_no_leak(llm.engine)


def _contains(tokens: list[int], seq) -> bool:
    return any(tokens[i:i + len(seq)] == list(seq) for i in range(len(tokens)))


def _word_it_wrote(tokenizer, vocab, prompt_ids, tokens, length) -> tuple[str, tuple]:
    """A word whose token sequences (bad_word_sequences's) include one of `length` tokens the output
    holds; for two tokens, one whose first is not the prompt's last (HF matches a prefix in the
    prompt too, vLLM only in the output)."""
    for i in range(len(tokens) - length + 1):
        word = tokenizer.decode(tokens[i:i + length]).strip()
        if not word:
            continue
        sequences = bad_word_sequences(tokenizer, [word], vocab)
        if any(_contains(tokens, s) and (len(s) == 1 or s[0] != prompt_ids[-1]) for s in sequences):
            return word, sequences
    raise AssertionError(f"no word of {length} token(s) in {tokens}")


def test_bad_words_match_hfs_bad_words_ids(llm, hf):
    """Words the unconstrained greedy output holds (of one token, and of two) are avoided as HF's
    bad_words_ids avoids their token sequences."""
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.loaded.model_config.vocab_size
    free = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    for output in free:
        ids, tokens = output.prompt_token_ids, output.outputs[0].token_ids
        for length in (1, 2):
            word, sequences = _word_it_wrote(tokenizer, vocab, ids, tokens, length)
            [ours] = llm.generate({"prompt_token_ids": ids}, _greedy(bad_words=[word]), use_tqdm=False)
            got = ours.outputs[0].token_ids
            assert got != tokens and not any(_contains(got, s) for s in sequences), (word, sequences)
            assert got == _hf_greedy(hf, ids, bad_words_ids=[list(s) for s in sequences]), (word, sequences)
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_masks_hold_for_every_sample_of_n_with_async_scheduling(llama_dir, async_scheduling):
    llm = LLM(str(llama_dir), **OPTIONS, async_scheduling=async_scheduling)
    tokenizer = llm.get_tokenizer()
    allowed = sorted(set(tokenizer.encode("the water is cold and the sea is deep", add_special_tokens=False)))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, allowed_token_ids=allowed)
    plain = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16)  # (same batch: unmasked rows stay free)
    masked, free = llm.generate(["The water is", "The water is"], [params, plain], use_tqdm=False)
    assert all(set(c.token_ids) <= set(allowed) for c in masked.outputs)
    assert any(not set(c.token_ids) <= set(allowed) for c in free.outputs)
    vocab = llm.engine.loaded.model_config.vocab_size
    word, sequences = _word_it_wrote(tokenizer, vocab, masked.prompt_token_ids, free.outputs[0].token_ids, 2)
    [banned] = llm.generate("The water is", plain.clone(bad_words=[word]), use_tqdm=False)
    assert not any(_contains(c.token_ids, s) for c in banned.outputs for s in sequences)
    assert_no_leak(llm.engine)


def test_truncate_prompt_tokens_keeps_the_last_tokens_through_the_prefix_cache(llm):
    tokenizer = llm.get_tokenizer()
    long = " ".join(["the water is cold"] * 80)
    ids = tokenizer.encode(long)
    assert len(ids) > OPTIONS["max_model_len"]
    params = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=40)
    first, again = (llm.generate(long, params, use_tqdm=False)[0] for _ in range(2))
    assert first.prompt_token_ids == ids[-40:] and first.prompt == long
    [direct] = llm.generate({"prompt_token_ids": ids[-40:]}, params.clone(truncate_prompt_tokens=None),
                            use_tqdm=False)
    assert first.outputs[0].token_ids == direct.outputs[0].token_ids == again.outputs[0].token_ids
    assert again.num_cached_tokens > 0
    short = llm.generate("The water is", params.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert short.prompt_token_ids == tokenizer.encode("The water is")  # (-1: the model's max length)
    with pytest.raises(ValueError, match="prompt"):  # max_model_len tokens leave no room to generate
        llm.generate(long, params.clone(truncate_prompt_tokens=-1), use_tqdm=False)
    assert_no_leak(llm.engine)


def test_detokenize_false_gives_token_ids_and_no_text(llm):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, n=1)
    [text] = llm.generate("The water is", params, use_tqdm=False)
    [ids_only] = llm.generate("The water is", params.clone(detokenize=False), use_tqdm=False)
    assert text.outputs[0].text and ids_only.outputs[0].text == ""
    assert ids_only.outputs[0].token_ids == text.outputs[0].token_ids
    assert all(entry.decoded_token is None for step in ids_only.outputs[0].logprobs for entry in step.values())


def test_requests_without_masks_never_reach_the_masking_code(llm, monkeypatch):
    def fail(*args):
        raise AssertionError("masking code ran for a batch with no masked request")
    monkeypatch.setattr(sampler_module, "apply_token_masks", fail)
    monkeypatch.setattr(sampler_module, "uses_token_masks", fail)  # (the runner's count says none: no scan)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=4, n=2), use_tqdm=False)
    assert all(len(c.token_ids) == 4 for o in outputs for c in o.outputs)
    assert llm.engine.runner.batch.num_masked == 0


class FreeContinuation(PerRequestProposer):
    """Drafts the unconstrained greedy continuation: tokens a mask forbids, which a verification that
    masked nothing would keep (a test double for where drafts come from)."""

    def __init__(self, continuation: list[int]):
        self.continuation, self.calls = continuation, 0

    def propose(self, request, k, threshold):
        self.calls += 1
        done = request.num_output_tokens
        return list(self.continuation[done:done + k])


def test_speculating_engines_mask_as_plain_ones(llama_dir, llm):
    """Requests with allowed_token_ids or bad_words get drafts, here the unconstrained continuation:
    the verification masks each row as the sampler does, so their tokens are the plain engine's."""
    def _undelayed(**fields):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    spec = LLM(str(llama_dir), **OPTIONS, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    tokenizer, vocab = llm.get_tokenizer(), llm.engine.loaded.model_config.vocab_size
    [free] = llm.generate("The water is", _undelayed(), use_tqdm=False)
    tokens = free.outputs[0].token_ids
    drafts = spec.engine.speculator.proposers[spec.engine.speculator.config] = FreeContinuation(tokens)
    assert spec.generate("The water is", _undelayed(), use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert drafts.calls > 0  # (an unmasked request is drafted for)
    word, _ = _word_it_wrote(tokenizer, vocab, free.prompt_token_ids, tokens[1:], 1)
    for fields in ({"allowed_token_ids": [t for t in range(vocab) if t != tokens[1]]}, {"bad_words": [word]}):
        [plain] = llm.generate("The water is", _undelayed(**fields), use_tqdm=False)
        drafts.calls = 0
        [drafted] = spec.generate("The water is", _undelayed(**fields), use_tqdm=False)
        assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids != tokens, fields
        assert drafts.calls > 0, fields
    assert_no_leak(spec.engine)
