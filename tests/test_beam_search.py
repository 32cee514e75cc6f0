"""`LLM.beam_search` (vLLM's offline beam search) on tiny random models made here: where no beam ends
(EOS never among the candidates) it returns what HF transformers' `generate(num_beams=...)` returns;
where beams end, it follows vLLM's rule, checked against that rule written out below over HF's
logits (entrypoints/beam_search.py says where HF's differs). Each step computes one token per beam
(the parent's KV is forked), and nothing is left held."""
import pytest
import torch
import transformers

from conftest import assert_no_leak
from treeserve import LLM, BeamSearchParams
from treeserve.errors import ParamError
from treeserve.testing.tiny_models import make_tiny_model

PROMPTS = ["The water is", "A long time ago in a place far away there was", "x"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two llama-shaped models: one that never puts EOS among its best candidates, one that often does."""
    root = tmp_path_factory.mktemp("beam")
    paths = {"no_eos": make_tiny_model("llama", root / "no_eos", seed=11, favour_tokens={"<|eos|>": -20.0}),
             "eos": make_tiny_model("llama", root / "eos", seed=11, favour_tokens={"<|eos|>": 3.0})}
    return {name: (LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, block_size=4),
                   transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
            for name, path in paths.items()}


def _hf_beams(hf, ids, width, max_tokens, length_penalty):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=True, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=hf.config.pad_token_id)
    # (HF divides by the generated length)
    cum = out.sequences_scores * (out.sequences.shape[1] - len(ids)) ** length_penalty
    return out.sequences.tolist(), cum.tolist()


def _vllm_rule(hf, ids, width, max_tokens, length_penalty, eos, ignore_eos=False):
    """vLLM's LLM.beam_search, written out over HF's logits (whole sequences, no cache)."""
    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty
    beams, completed = [(list(ids), 0.0)], []
    for _ in range(max_tokens):
        fresh = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(logprobs, 2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                child = (tokens + [token], cum + logprob)
                (completed if token == eos and not ignore_eos else fresh).append(child)
        beams = sorted(fresh, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_matches_hf_generate_where_no_beam_ends(models, length_penalty):
    llm, hf = models["no_eos"]
    tokenizer = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt)
        sequences, cum = _hf_beams(hf, ids, 3, 10, length_penalty)
        assert [s.tokens for s in output.sequences] == sequences, prompt  # (prompt included, as vLLM's)
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(cum, abs=1e-4)
        for sequence in output.sequences:
            assert sequence.text == tokenizer.decode(sequence.tokens)
            assert len(sequence.logprobs) == 10 and sequence.finish_reason == "length"
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_beam_search_follows_vllms_rule_where_beams_end(models, length_penalty):
    """EOS among the candidates: every EOS candidate is kept as completed, ranked by the length with
    the prompt and without the EOS, as vLLM's (HF keeps fewer and divides by another length)."""
    llm, hf = models["eos"]
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty))
    ended = 0
    for prompt, output in zip(PROMPTS, outputs):
        expected = _vllm_rule(hf, tokenizer.encode(prompt), 3, 8, length_penalty, eos)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected], prompt
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([c for _, c in expected], abs=1e-4)
        for sequence in output.sequences:
            assert sequence.finish_reason == ("stop" if sequence.tokens[-1] == eos else "length")
            ended += sequence.tokens[-1] == eos
    assert ended, "no returned beam ended: the test would not check vLLM's rule for finished beams"
    assert_no_leak(llm.engine)


def test_ignore_eos_grows_every_beam_to_max_tokens(models):
    llm, hf = models["eos"]
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[0])
    [output] = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    expected = _vllm_rule(hf, ids, 3, 6, 1.0, tokenizer.eos_token_id, ignore_eos=True)
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
    assert all(len(s.tokens) == len(ids) + 6 for s in output.sequences)


def test_each_step_computes_one_token_per_beam(models, monkeypatch):
    """Beams share their prompt and their parents' KV: after the prompt, every scoring request finds
    all but its last token already computed (vLLM resubmits whole sequences to its prefix cache)."""
    llm, _ = models["no_eos"]
    seen = []
    add = llm.loop.add_request

    def spying(engine, request_id, token_ids, params, on_output, **options):
        def record(output):
            if output.finished:
                seen.append((len(token_ids), output.num_cached_tokens))
            on_output(output)
        add(engine, request_id, token_ids, params, record, **options)
    monkeypatch.setattr(llm.loop, "add_request", spying)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    llm.engine.reset_prefix_cache()
    llm.beam_search([ids, ids], BeamSearchParams(beam_width=4, max_tokens=5))
    later = [(length, cached) for length, cached in seen if length > len(ids)]
    assert len(later) == 2 * 4 * 4
    assert all(cached == length - 1 for length, cached in later)
    assert_no_leak(llm.engine)


def test_bad_beam_search_calls_are_param_errors(models):
    llm, _ = models["no_eos"]
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=4, temperature=-1), dict(beam_width=2, max_tokens=4, ignore_eos=1)):
        with pytest.raises(ParamError):
            BeamSearchParams(**bad)
    from treeserve import SamplingParams
    with pytest.raises(ParamError, match="^params: expected BeamSearchParams"):
        llm.beam_search(["x"], SamplingParams())
    with pytest.raises(ParamError, match="^concurrency_limit"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    assert_no_leak(llm.engine)


def test_concurrency_limit_searches_prompts_in_turns_with_the_same_result(models):
    llm, _ = models["no_eos"]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    together = llm.beam_search(PROMPTS, params)
    in_turns = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in in_turns] == [[s.tokens for s in o.sequences] for o in together]


def test_llm_engine_is_vllms_name_for_the_engine(models):
    llm, _ = models["no_eos"]
    assert llm.llm_engine is llm.engine
    assert llm.llm_engine.tokenizer is llm.get_tokenizer()
