"""Sampler semantics on hand-made logits, and stop conditions end to end."""
import math

import pytest
import torch

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.engine.request import Request
from treeserve.engine.sampler import Sampler, _filter, _inverse_transform
from treeserve.engine.seeded_draws import DRAW_CHUNK, SeededDraws


def _requests(*params, outputs=None, prompt=(1, 2)):
    reqs = [Request(f"r{i}", list(prompt), p) for i, p in enumerate(params)]
    for r, out in zip(reqs, outputs or [[]] * len(reqs)):
        for t in out:
            r.append_output_token(t)
    return reqs


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.25)]
    kept = torch.isfinite(_filter(logits.clone(), params))
    assert kept[0].tolist() == [True, True, False, False, False]
    assert kept[1].tolist() == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert kept[2].tolist() == [True, True, True, False, False]   # >= 0.25 * 0.5


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05]]))
    kept = torch.isfinite(_filter(logits, [SamplingParams(top_p=0.01)]))
    assert kept[0].tolist() == [True, False, False]


def test_a_row_without_top_k_or_top_p_keeps_every_token_whatever_shares_its_batch():
    """A row without top-k or top-p filters nothing beside a row with top_k (or top_p): the running
    sum of its sorted probabilities overshoots 1 in float32, which once cut ~1,200 of its 32,000 least
    likely tokens, so its tokens (a seeded request's too, with drafts or without) hung on its batch."""
    torch.manual_seed(0)
    logits = torch.randn(4, 32000) * 3
    free = SamplingParams(temperature=1.0)
    for neighbour in (SamplingParams(top_k=5), SamplingParams(top_p=0.9), SamplingParams(top_k=5, top_p=0.9)):
        filtered = _filter(torch.cat([logits, logits[:1]]), [free] * 4 + [neighbour])
        assert torch.equal(filtered[:4], logits), neighbour
        assert torch.isinf(filtered[4]).sum() >= 32000 - 5 if neighbour.top_k else torch.isinf(filtered[4]).any()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    params = SamplingParams(temperature=1.0, seed=0)
    request = _requests(params)[0]
    counts = torch.zeros(3)
    sampler = Sampler()
    for _ in range(3000):  # (a seeded request's draw is keyed by the position it samples: one after another)
        token = sampler(torch.log(probs)[None, :].clone(), [request]).token_ids[0]
        counts[token] += 1
        request.append_output_token(token)
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_inverse_transform_never_returns_an_impossible_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    draws = torch.tensor([0.0, 0.4999, 0.5, 1.0], dtype=torch.float64)  # 1.0: rounding up to the total
    assert _inverse_transform(probs, draws).tolist() == [1, 1, 3, 3]


def test_inverse_transform_at_the_total_takes_the_last_possible_token():
    """A draw that rounds onto the total takes the row's last token of probability above zero, read
    from the probabilities: here one too small to move the float32 running sum (a device's scan may
    also add a row's zeros in another order, so the sum is no guide to where they start)."""
    probs = torch.tensor([[0.25, 0.75, 1e-9, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
    assert _inverse_transform(probs, torch.tensor([1.0, 1.0], dtype=torch.float64)).tolist() == [2, 1]


def test_seeded_draws_are_their_generators_numbers_in_order():
    """`SeededDraws` draws its seed's numbers a chunk at a time; the k-th is still the generator's
    k-th number drawn one by one, asked in any order."""
    one_by_one = torch.Generator().manual_seed(11)
    expected = [float(torch.rand((), dtype=torch.float64, generator=one_by_one)) for _ in range(3 * DRAW_CHUNK + 5)]
    draws = SeededDraws(11)
    assert draws.at(DRAW_CHUNK + 2) == expected[DRAW_CHUNK + 2]
    assert [draws.at(k) for k in range(len(expected))] == expected


def test_a_batch_of_greedy_and_sampled_rows_takes_each_rows_rule():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]] * 4))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    tokens = Sampler()(logits.clone(), _requests(*params)).token_ids
    alone = Sampler()(logits[:1].clone(), _requests(params[1])).token_ids[0]
    assert tokens[0] == tokens[2] == 1 and tokens[1] == tokens[3] == alone


def test_seeded_rows_sample_alike_in_any_batch():
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5]] * 3))
    sampler, seeded = Sampler(), SamplingParams(temperature=1.0, seed=7)
    alone, mixed = _requests(seeded), _requests(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), seeded)
    def tokens(rows, batch, row):
        out = []
        for _ in range(30):
            out.append(sampler(rows.clone(), batch).token_ids[row])
            batch[row].append_output_token(out[-1])
        return out
    alone_tokens, mixed_tokens = tokens(logits[:1], alone, 0), tokens(logits, mixed, 2)
    assert alone_tokens == mixed_tokens and len(set(alone_tokens)) == 3


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    sampler = Sampler()
    req = _requests(SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5), outputs=[[0, 0]])[0]
    out = sampler._apply_penalties(logits.clone(), [req])
    assert out[0].tolist() == pytest.approx([2.0 - 1.0 - 1.0, 1.0, -1.0, 0.5])
    req = _requests(SamplingParams(temperature=0, repetition_penalty=2.0), outputs=[[2]], prompt=(0,))[0]
    out = sampler._apply_penalties(logits.clone(), [req])
    assert out[0].tolist() == pytest.approx([1.0, 1.0, -2.0, 0.5])


def test_greedy_and_min_tokens_mask_eos():
    sampler = Sampler()
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    req = Request("r", [1], SamplingParams(temperature=0, min_tokens=2), eos_token_ids=(0,))
    assert sampler(logits.clone(), [req]).token_ids == [1]
    req.append_output_token(1)
    req.append_output_token(1)
    assert sampler(logits.clone(), [req]).token_ids == [0]


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    req = _requests(SamplingParams(temperature=0, logprobs=2))[0]
    out = Sampler()(logits.clone(), [req])
    ref = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [2]
    assert out.logprobs[0][2] == (pytest.approx(float(ref[2])), 1)
    assert out.logprobs[0][1] == (pytest.approx(float(ref[1])), 2)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)


def _free_text(llm, prompt, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_stop_strings_are_never_emitted_partially(llm):
    prompt = "They said that every good answer"
    full = _free_text(llm, prompt)
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = _free_text(llm, prompt, stop=[stop, "never-appears"])
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = _free_text(llm, prompt, stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert_no_leak(llm.engine)


def test_stop_token_ids_and_max_tokens(llm):
    full = _free_text(llm, "Hello there")
    target = full.token_ids[5]
    out = _free_text(llm, "Hello there", stop_token_ids=[target])
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert full.finish_reason == "length" and len(full.token_ids) == 30


def test_eos_stops_unless_ignored(llm, monkeypatch):
    full = _free_text(llm, "Hello there")
    fake_eos = full.token_ids[4]
    monkeypatch.setattr(llm.engine.generation_defaults, "eos_token_ids", (fake_eos,))
    params = SamplingParams(temperature=0.0, max_tokens=30)
    stopped = llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(fake_eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate("Hello there", params.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == full.token_ids
    delayed = llm.generate("Hello there", params.clone(min_tokens=29), use_tqdm=False)[0].outputs[0]
    assert len(delayed.token_ids) >= 29


def test_text_equals_full_decode(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, skip_special_tokens=True)
    for out in llm.generate(["café 日本語", "😀 🚀", "Привет"], params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_cumulative_logprob(llm):
    out = _free_text(llm, "Hello", logprobs=0)
    total = sum(step[t].logprob for t, step in zip(out.token_ids, out.logprobs))
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)
