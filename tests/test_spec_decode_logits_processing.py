"""Speculation for requests whose logits the sampler processes: penalties, allowed_token_ids,
bad_words, min_tokens. Each verified row is processed as a plain decode row after the drafts before
it (a penalty counts them, a bad word's prefix may end in them, min_tokens counts them): checked row
by row on hand-made logits; greedy tokens equal decoding without speculation, with reference, n-gram
and draft-model drafts; seeded samples are the very tokens of decoding without it; sampled tokens
keep the penalized distribution (chi-square)."""
import math

import pytest
import torch

from conftest import assert_no_leak
from test_spec_decode import FixedDraft, _binned, _chi_square, _install, _llm, _spec, draft_always
from test_spec_decode_draft_model import _draft, _perturbed_copy
from test_token_masks import _word_it_wrote
from treeserve import SamplingParams
from treeserve.engine.input_batch import CachedRequestState
from treeserve.engine.spec_decode.proposer import PerRequestProposer
from treeserve.engine.request import Request
from treeserve.engine.spec_decode.draft_rows import permitted_drafts
from treeserve.engine.spec_decode.rejection import verify

TEXT = ["The water is", "Once upon a time there was a little", "1 + 2 ="]
BASE = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
VOCAB, EOS = 16, 0


def _state(outputs: list[int], bad_words=(), **fields) -> CachedRequestState:
    """A decoding request of prompt [1, 2, 3] that has emitted `outputs` (the last one not yet computed)."""
    params = SamplingParams(temperature=0.0, max_tokens=50, **fields)
    params.bad_words_token_ids = tuple(tuple(w) for w in bad_words)
    tokens = [1, 2, 3] + outputs
    return CachedRequestState("r", tokens, 3, [], len(tokens) - 1, params, (EOS,), False, None, None, None)


def _rows(*preferences: list[int]) -> torch.Tensor:
    """One logits row per preference list: its tokens from most to least likely, the rest far below."""
    logits = torch.full((len(preferences), VOCAB), -10.0)
    for row, tokens in enumerate(preferences):
        for rank, token in enumerate(tokens):
            logits[row, token] = 8.0 - rank
    return logits


# (state fields, drafts, each row's preferences, the tokens emitted): the model at each row prefers
# the next draft, but the row's processing, with the drafts before it in the output, refuses it
VERIFIED = {
    "frequency_penalty": ({"frequency_penalty": 1.5}, [9], [5, 5], [[5, 6], [5, 6], [7]], [5, 6]),
    "presence_penalty": ({"presence_penalty": 1.5}, [9], [5, 5], [[5, 6], [5, 6], [7]], [5, 6]),
    "repetition_penalty": ({"repetition_penalty": 2.0}, [9], [5, 5], [[5, 6], [5, 6], [7]], [5, 6]),
    "a penalty counts the output too": ({"frequency_penalty": 1.5}, [5], [5], [[5, 6], [7]], [6]),
    "bad_words": ({"bad_words": [[5, 6]]}, [9], [5, 6], [[5], [6, 7], [8]], [5, 7]),
    "bad_words across the output": ({"bad_words": [[9, 5, 6]]}, [9], [5, 6], [[5], [6, 7], [8]], [5, 7]),
    "allowed_token_ids": ({"allowed_token_ids": [5, 7, 8]}, [9], [5, 6], [[5], [6, 7], [8]], [5, 7]),
    "min_tokens": ({"min_tokens": 3}, [9], [5, 6, 7], [[EOS, 5], [EOS, 6], [EOS, 7], [EOS]], [5, 6, EOS]),
    "min_tokens reached": ({"min_tokens": 1}, [9], [5, 6], [[5], [EOS, 6], [EOS]], [5, EOS]),
    "unprocessed": ({}, [9], [5, 5], [[5, 6], [5, 6], [7]], [5, 5, 7]),
}


@pytest.mark.parametrize("case", VERIFIED)
def test_each_verified_row_is_processed_after_the_drafts_before_it(case):
    fields, outputs, drafts, preferences, emitted = VERIFIED[case]
    fields = dict(fields)
    state = _state(outputs, fields.pop("bad_words", ()), **fields)
    got = verify(_rows(*preferences), [(state, drafts)])["r"]
    assert [token for token, _ in got] == emitted


class Unread(CachedRequestState):
    """A request whose histories must not be read (its rows take no penalty)."""

    @property
    def output_token_ids(self):
        raise AssertionError(f"{self.request_id}'s output was read")

    @property
    def prompt_token_ids(self):
        raise AssertionError(f"{self.request_id}'s prompt was read")


def test_only_penalized_rows_read_their_histories():
    """Beside a penalized request, an unpenalized one's k + 1 rows cost no history (each row's
    output and prompt; a batch of 64 such requests with 8 drafts each spent tens of milliseconds
    a step building them); both emit what they would alone."""
    penalized = _state([9], repetition_penalty=2.0)
    free = _state([9])
    free.__class__, free.request_id = Unread, "free"
    preferences = [[5, 6], [5, 6], [7]]
    got = verify(torch.cat([_rows(*preferences), _rows(*preferences)]), [(penalized, [5, 5]), (free, [5, 5])])
    assert [t for t, _ in got["r"]] == [5, 6] and [t for t, _ in got["free"]] == [5, 5, 7]


class Counted(CachedRequestState):
    """A request that counts how often its histories are read."""
    reads = 0

    @property
    def output_token_ids(self):
        Counted.reads += 1
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self):
        Counted.reads += 1
        return self.token_ids[:self.num_prompt_tokens]


@pytest.mark.parametrize("case", ["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_a_requests_histories_are_read_once_for_all_its_rows(case):
    """The k + 1 rows of a penalized request count its output (and its prompt) once, then each its
    own drafts: their tokens are those of the rows read one by one."""
    fields, outputs, drafts, preferences, emitted = VERIFIED[case]
    state = _state(outputs, **fields)
    state.__class__, Counted.reads = Counted, 0
    got = verify(_rows(*preferences), [(state, drafts)])["r"]
    assert [token for token, _ in got] == emitted
    assert Counted.reads == (2 if case == "repetition_penalty" else 1)


def test_unprocessed_requests_build_no_row_views(monkeypatch):
    """A verification where no request's logits are processed (the common case) builds no view per
    row (576 of them for 64 requests with 8 drafts each: 0.3 ms of host work a step); a logit bias
    alone still applies to every row."""
    from treeserve.engine.spec_decode import rejection

    def refused(rows):
        raise AssertionError("row views built")
    monkeypatch.setattr(rejection, "draft_rows", refused)
    fields, outputs, drafts, preferences, emitted = VERIFIED["unprocessed"]
    assert [t for t, _ in verify(_rows(*preferences), [(_state(outputs), drafts)])["r"]] == emitted
    monkeypatch.undo()
    biased = _state(outputs, logit_bias={5: -5.0})
    assert [t for t, _ in verify(_rows(*preferences), [(biased, drafts)])["r"]] == [6]


def test_bad_words_of_every_row_are_masked_in_one_copy(monkeypatch):
    """A verified request's k + 1 rows (and every other row) take their bad words' tokens to the
    device in one copy, masked by one operation (a copy and a kernel per row cost 2.8 ms of a
    step's host time at 64 requests with 8 drafts each); the tokens are those of the rows one by one."""
    from treeserve.engine import token_masks
    copies = []
    monkeypatch.setattr(token_masks, "to_device", lambda t, device: copies.append(t) or t)
    fields, outputs, drafts, preferences, emitted = VERIFIED["bad_words across the output"]
    other = _state([5], bad_words=[[5, 6], [7]])
    other.request_id = "other"
    got = verify(torch.cat([_rows(*preferences), _rows([6, 7, 8], [9])]),
                 [(_state(outputs, fields["bad_words"]), drafts), (other, [6])])
    assert [t for t, _ in got["r"]] == emitted and [t for t, _ in got["other"]] == [8]
    assert len(copies) == 1


class UnreadHistory(CachedRequestState):
    """A request whose whole output must not be copied (its recent tokens may be read)."""

    @property
    def output_token_ids(self):
        raise AssertionError(f"{self.request_id}'s output was copied")


def test_bad_words_read_only_the_end_of_each_rows_output():
    """A verified request's k + 1 rows with bad_words (and no penalty) read the few tokens a bad word's
    prefix may match, not a copy of the request's output per row (at 64 requests with 8 drafts and
    2,000 tokens of output each, 2.4 ms of a step's host time; 0.9 ms after); the tokens are those of
    the rows one by one."""
    fields, outputs, drafts, preferences, emitted = VERIFIED["bad_words across the output"]
    state = _state([4] * 50 + outputs, fields["bad_words"])
    state.__class__ = UnreadHistory
    assert [t for t, _ in verify(_rows(*preferences), [(state, drafts)])["r"]] == emitted


def _request(outputs: list[int], bad_words=(), **fields) -> Request:
    """The engine's request of prompt [1, 2, 3] that has emitted `outputs`."""
    params = SamplingParams(temperature=0.0, max_tokens=50, **fields)
    params.bad_words_token_ids = tuple(tuple(w) for w in bad_words)
    request = Request("r", [1, 2, 3], params, eos_token_ids=(EOS,))
    for token in outputs:
        request.append_output_token(token)
    return request


# (state fields, output so far, drafts, the drafts verified): cut at the first one its row masks
PERMITTED = {
    "allowed_token_ids": ({"allowed_token_ids": [5, 6, 7]}, [5], [6, 5, 9, 6], [6, 5]),
    "allowed_token_ids, the first draft": ({"allowed_token_ids": [5, 6, 7]}, [5], [8, 5], []),
    "a one-token bad word": ({"bad_words": [[7]]}, [5], [5, 6, 7, 5], [5, 6]),
    "a bad word after drafts": ({"bad_words": [[5, 6]]}, [9], [7, 5, 6, 8], [7, 5]),
    "a bad word across the output": ({"bad_words": [[9, 5, 6]]}, [8, 9], [5, 6, 7], [5]),
    "a bad word's prefix elsewhere": ({"bad_words": [[5, 6]]}, [9], [6, 5, 5, 7], [6, 5, 5, 7]),
    "EOS before min_tokens": ({"min_tokens": 3}, [5], [6, EOS, 7], [6]),
    "EOS at min_tokens": ({"min_tokens": 3}, [5], [6, 7, EOS], [6, 7, EOS]),
    "a stop token before min_tokens": ({"min_tokens": 2, "stop_token_ids": [8]}, [], [5, 8, 8], [5]),
    "EOS ignored": ({"min_tokens": 3, "ignore_eos": True}, [5], [EOS, EOS], [EOS, EOS]),
    "a penalty forbids nothing": ({"frequency_penalty": 2.0}, [5], [5, 5], [5, 5]),
}


@pytest.mark.parametrize("case", PERMITTED)
def test_drafts_stop_before_the_first_one_the_requests_processing_forbids(case):
    """A draft its row's processing masks is never kept: it and the drafts after it were verified
    for nothing (rows computed, their drafts counted as rejected). Its row still runs."""
    fields, outputs, drafts, permitted = PERMITTED[case]
    fields = dict(fields)
    assert permitted_drafts(_request(outputs, fields.pop("bad_words", ()), **fields), drafts) == permitted


class Forbidden(PerRequestProposer):
    """Drafts `good` then a forbidden token then `good` again, k in all."""

    def __init__(self, good: int, forbidden: int):
        self.good, self.forbidden = good, forbidden

    def propose(self, request, k, threshold):
        return ([self.good, self.forbidden] + [self.good] * k)[:k]


def _forbidding(plain, case: str) -> tuple[dict, int]:
    """The case's fields and a token they forbid at every row of `TEXT`'s greedy decoding."""
    tokenizer, vocab = plain.get_tokenizer(), plain.engine.loaded.model_config.vocab_size
    if case == "allowed_token_ids":
        return {"allowed_token_ids": [t for t in range(vocab) if t != 9]}, 9
    if case == "bad_words":
        [free] = plain.generate(TEXT[:1], SamplingParams(**BASE), use_tqdm=False)
        word, sequences = _word_it_wrote(tokenizer, vocab, free.prompt_token_ids, free.outputs[0].token_ids, 1)
        return {"bad_words": [word]}, next(s[0] for s in sequences if len(s) == 1)
    return {"min_tokens": BASE["max_tokens"], "ignore_eos": False}, plain.engine.loaded.eos_token_ids[0]


@pytest.mark.parametrize("case", ["allowed_token_ids", "bad_words", "min_tokens"])
def test_an_engine_verifies_no_draft_after_a_forbidden_one(plain, llama_dir, case):
    """Drafts [good, forbidden, good, good] reach verification as [good]: one draft token a step, the
    three after it never verified for nothing; the greedy tokens are those of decoding without
    speculation."""
    fields, forbidden = _forbidding(plain, case)
    good = 7 if forbidden != 7 else 8
    llm = draft_always(_install(_llm(llama_dir, max_model_len=256, speculative_config=_spec(k=4)),
                                Forbidden(good, forbidden)))
    params = SamplingParams(**{**BASE, **fields})
    expected = [o.outputs[0].token_ids for o in plain.generate(TEXT, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(TEXT, params, use_tqdm=False)] == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens == stats.spec_decode_num_drafts  # (one each: good)
    assert_no_leak(llm.engine)


def _cases(llm) -> dict[str, dict]:
    """Each processing, with values that change the greedy tokens of `TEXT` (checked by the test)."""
    tokenizer, vocab = llm.get_tokenizer(), llm.engine.loaded.model_config.vocab_size
    [free] = llm.generate(TEXT[:1], SamplingParams(**BASE), use_tqdm=False)
    ids, tokens = free.prompt_token_ids, free.outputs[0].token_ids
    word, _ = _word_it_wrote(tokenizer, vocab, ids, tokens, 2)  # (a two-token word: its prefix may be a draft)
    return {"repetition_penalty": {"repetition_penalty": 1.3},
            "frequency_penalty": {"frequency_penalty": 0.6},
            "presence_penalty": {"presence_penalty": 0.8},
            "penalties_together": {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3},
            "allowed_token_ids": {"allowed_token_ids": [t for t in range(vocab) if t not in tokens[1:8:3]]},
            "bad_words": {"bad_words": [word]},
            "min_tokens": {"min_tokens": 20, "ignore_eos": False, "stop_token_ids": [tokens[2], tokens[5]]}}


def _generate(llm, fields: dict, proposer=None):
    """Each prompt's tokens and finish reason; `proposer` (a ProcessedReference) learns them."""
    outputs = llm.generate(TEXT, SamplingParams(**{**BASE, **fields}), use_tqdm=False)
    if proposer is not None:
        proposer.by_prompt = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def plain(llama_dir):
    return _llm(llama_dir, max_model_len=256)


@pytest.fixture(scope="module")
def perturbed(llama_dir, tmp_path_factory):
    return _perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft") / "perturbed", scale=0.2)


class ProcessedReference(PerRequestProposer):
    """Drafts the plain engine's tokens under the case's processing, every third draft spoiled:
    drafts kept, rejected mid-way and kept whole, so every row after a kept draft is processed
    with it in the output (a test double; the verification is the engine's)."""

    def __init__(self):
        self.by_prompt, self.calls = {}, 0

    def propose(self, request, k, threshold):
        self.calls += 1
        done = request.num_output_tokens
        draft = list(self.by_prompt[tuple(request.prompt_token_ids)][done:done + k])
        if self.calls % 3 == 0 and draft:
            draft[-1] = (draft[-1] + 1) % 64
        return draft


@pytest.fixture(scope="module")
def speculating(llama_dir, perturbed):
    """A speculating engine per method, made once: `speculating(method)`."""
    made = {}

    def make(method):
        if method not in made:
            config = _draft(perturbed) if method == "draft_model" else _spec(k=4, prompt_lookup_min=1)
            llm = _llm(llama_dir, max_model_len=256, speculative_config=config)
            if method == "reference":
                _install(llm, ProcessedReference())
            made[method] = draft_always(llm)
        return made[method]
    return make


CASES = ["repetition_penalty", "frequency_penalty", "presence_penalty", "penalties_together", "allowed_token_ids",
         "bad_words", "min_tokens"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", ["reference", "ngram", "draft_model"])
def test_greedy_tokens_with_each_processing_equal_decoding_without_speculation(plain, speculating, method, case):
    llm = speculating(method)
    fields = _cases(plain)[case]
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.config]
    expected = _generate(plain, fields, proposer if method == "reference" else None)
    assert expected != _generate(plain, {}), f"{case} changes nothing here: no test of it"
    before = llm.engine.stats()
    assert _generate(llm, fields) == expected
    after = llm.engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    kept = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted > 0  # (no request is left without drafts for its processing)
    if method != "ngram":  # (n-gram drafts of a penalized output are mostly wrong: they may all be refused)
        assert drafted > kept > 0, (drafted, kept)
    assert_no_leak(llm.engine)


def _seeded(fields: dict) -> SamplingParams:
    return SamplingParams(**{**BASE, "temperature": 1.0, "top_p": 0.9, "seed": 7, "logprobs": 1, **fields})


@pytest.mark.parametrize("method", ["reference", "ngram"])
def test_seeded_samples_with_processing_equal_those_without_speculation(plain, speculating, method):
    """A seeded request's number for each position is its seed's, drafts or not: with every processing
    at once, its sampled tokens (and logprobs) are those of decoding without speculation."""
    fields = {k: v for case in ("penalties_together", "bad_words", "allowed_token_ids", "min_tokens")
              for k, v in _cases(plain)[case].items()}
    llm = speculating(method)
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.config]
    params = _seeded(fields)
    expected = plain.generate(TEXT, params, use_tqdm=False)
    if method == "reference":
        proposer.by_prompt = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}
    before = llm.engine.stats()
    got = llm.generate(TEXT, params, use_tqdm=False)
    for a, b in zip(expected, got):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert [e.keys() for e in x.logprobs] == [e.keys() for e in y.logprobs]
    after = llm.engine.stats()
    assert after.spec_decode_num_draft_tokens > before.spec_decode_num_draft_tokens
    if method == "reference":
        assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    assert_no_leak(llm.engine)


FREQUENCY = 2.0


def _penalized_top3(plain, prompt: list[int], outputs: tuple[int, ...], penalty=FREQUENCY) -> dict[int, float]:
    """p(next | prompt + outputs) at temperature 1, top_k=3, with frequency_penalty FREQUENCY on the
    outputs' counts: the model's raw logprobs (a positive penalty only lowers: the top 3 after it lie
    in the top 3 + len(outputs) before), penalized, cut to 3, renormalized."""
    out = plain.generate([{"prompt_token_ids": prompt + list(outputs)}],
                         SamplingParams(temperature=0, max_tokens=1, logprobs=3 + len(outputs)),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    scores = {t: lp.logprob - penalty * outputs.count(t) for t, lp in out.items() if lp.rank <= 3 + len(outputs)}
    top = sorted(scores, key=scores.get, reverse=True)[:3]
    total = sum(math.exp(scores[t]) for t in top)
    return {t: math.exp(scores[t]) / total for t in top}


def test_penalized_samples_keep_the_penalized_distribution(llama_dir, plain):
    """20,000 draws of three tokens at temperature 1, top_k=3, frequency_penalty=2: the second and
    third come from one verified step whose draft for the second is one of its row's top 3 (kept
    when its row samples it), the one the model most likely repeats third, unpenalized: the third
    row must count it. The joint frequencies against the product of the penalized conditionals
    (chi-square, p > 0.01); a verification that left the draft out of the third row's counts fails."""
    prompt = [3, 4] * 4  # (a prompt after which the tiny model likely repeats a token of its top 3)
    first = _penalized_top3(plain, prompt, ())
    likely = max(first, key=first.get)
    second = _penalized_top3(plain, prompt, (likely,))
    draft = max(second, key=lambda d: _penalized_top3(plain, prompt, (likely, d), penalty=0).get(d, 0.0))
    llm = _llm(llama_dir, max_num_seqs=256, speculative_config=_spec(k=1))
    _install(llm, FixedDraft(draft))
    expected = {(): 1.0}
    for _ in range(3):
        expected = {seq + (t,): p * q for seq, p in expected.items()
                    for t, q in _penalized_top3(plain, prompt, seq).items()}
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, n=100, frequency_penalty=FREQUENCY)
    counts = dict.fromkeys(expected, 0)
    for output in llm.generate([{"prompt_token_ids": prompt}] * 200, params, use_tqdm=False):
        for c in output.outputs:
            counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    total = sum(counts.values())
    assert total == 20_000
    observed, wanted = _binned(counts, {c: expected.get(c, 0.0) * total for c in counts})
    statistic, p_value = _chi_square(observed, wanted)
    assert p_value > 0.01, (statistic, p_value, counts, expected)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # both branches ran
    assert_no_leak(llm.engine)
