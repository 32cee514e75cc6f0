"""Async output processing (on by default on CUDA): a step's text is made while the device runs the
next step. Every output must equal the synchronous engine's: tokens, text, logprobs, finish and
stop reasons, with stop strings (made at once), stop tokens, n > 1, min_tokens, prompt logprobs and
prefill-only readouts mixed in one batch; and nothing may leak."""
import pytest

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams

PROMPTS = ["Hello there", "The water is", "A long time ago in a place far away", "x", "Step 1: add the",
           "They said that", "café 日本語"]


def _params():
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=3, max_tokens=16, n=3),
        SamplingParams(temperature=0, max_tokens=30, stop=["e", "at"]),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=5, prompt_logprobs=1),
        SamplingParams(temperature=0.7, seed=1, max_tokens=25, top_k=20, top_p=0.9),
        SamplingParams(temperature=0, max_tokens=12, stop=["the"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=18, skip_special_tokens=False),
    ]


def _summary(outputs):
    rows = []
    for out in outputs:
        rows.append((out.request_id, out.prompt_logprobs and [sorted(e) if e else e for e in out.prompt_logprobs],
                     [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                       c.logprobs and [{t: (round(lp.logprob, 5), lp.rank, lp.decoded_token) for t, lp in e.items()}
                                       for e in c.logprobs]) for c in out.outputs]))
    return rows


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_async_output_processing_gives_the_synchronous_outputs(tiny_model_dirs, family):
    path = str(tiny_model_dirs[family])
    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    sync = LLM(path, async_output_processing=False, **options)
    deferred = LLM(path, async_output_processing=True, **options)
    assert deferred.engine.outputs.async_output and not sync.engine.outputs.async_output
    expected = _summary(sync.generate(PROMPTS, _params(), use_tqdm=False))
    assert _summary(deferred.generate(PROMPTS, _params(), use_tqdm=False)) == expected
    assert any(c[2] == "stop" for _, _, cs in expected for c in cs), "expected a stop string to end some output"
    assert_no_leak(deferred.engine)


def test_outputs_of_the_last_step_arrive_and_readouts_are_not_delayed(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
              async_output_processing=True)
    engine = llm.engine
    ids = llm.get_tokenizer().encode("Hello there")
    engine.add_request("gen", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("readout", ids, SamplingParams(), logits_positions=[len(ids) - 1])
    first = {o.request_id: o for o in engine.step()}
    assert first["readout"].finished, "a prefill-only request's output waits for no text"
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    final = [o for o in seen if o.request_id == "gen" and o.finished]
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 3 and final[0].outputs[0].text
    assert_no_leak(engine)


def test_an_aborted_request_with_deferred_text_yields_nothing_more(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
              async_output_processing=True)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        assert all(o.request_id != "a" for o in engine.step())
    assert_no_leak(engine)


def test_an_id_freed_by_an_abort_is_taken_by_a_new_request_intact(tiny_model_dirs):
    """Deferred output of an aborted group never stands in for the new request that reuses its id."""
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
              async_output_processing=True)
    engine, loop, seen = llm.engine, llm.loop, []
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    loop.add_request(engine, "x", [5, 6, 7], params, seen.append)
    loop.step()
    assert loop.abort_request(engine, "x")
    loop.add_request(engine, "x", [9, 10, 11, 12], params, seen.append)
    loop.run_until(lambda: not engine.has_unfinished_requests())
    final = [o for o in seen if o.finished]
    assert len(final) == 1 and final[0].prompt_token_ids == [9, 10, 11, 12]
    assert len(final[0].outputs[0].token_ids) == 4 and final[0].outputs[0].finish_reason == "length"
    assert_no_leak(engine)


def test_aborting_a_request_whose_last_output_is_deferred_delivers_it(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
              async_output_processing=True)
    engine, loop, seen = llm.engine, llm.loop, []
    loop.add_request(engine, "y", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), seen.append)
    loop.step()  # prefill and the one token: finished, its output deferred
    assert not seen
    assert not loop.abort_request(engine, "y"), "it had already finished"
    loop.run_until(lambda: not engine.has_unfinished_requests())
    assert [o.finished for o in seen] == [True] and seen[0].outputs[0].finish_reason == "length"
    assert_no_leak(engine)
