"""Delta outputs (RequestOutputKind.DELTA, what streaming callers take): each RequestOutput holds only
what a sample added since the last one, so joined they equal the cumulative engine's last output
(text, token ids, logprobs, finish and stop reasons), with stop strings (no delta ever carries text
that a stop string later cuts), n > 1, async output processing and async scheduling; and no output
copies a request's whole token list."""
import pytest

from conftest import assert_no_leak
from test_async_output import PROMPTS, _params, _summary
from treeserve import LLM
from treeserve.outputs import CompletionOutput, RequestOutput
from treeserve.sampling_params import RequestOutputKind, SamplingParams

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)


def _stream(llm: LLM, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Every output of every request, stepping the engine directly."""
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), tokenizer.encode(prompt), p, prompt=prompt)
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
    return seen


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    """The deltas of one request joined into its cumulative form."""
    by_index: dict[int, CompletionOutput] = {}
    for output in outputs:
        assert output.delta
        for c in output.outputs:
            whole = by_index.setdefault(c.index, CompletionOutput(c.index, "", [], None, None if c.logprobs is None else []))
            whole.text += c.text
            whole.token_ids += c.token_ids
            if c.logprobs is not None:
                whole.logprobs += c.logprobs
            whole.cumulative_logprob, whole.finish_reason, whole.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                                c.stop_reason)
    last = outputs[-1]
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [by_index[i] for i in sorted(by_index)], last.finished, prompt_logprobs=last.prompt_logprobs)


@pytest.mark.parametrize("async_output,async_scheduling", [(False, False), (True, True)])
def test_joined_deltas_equal_the_cumulative_outputs(tiny_model_dirs, async_output, async_scheduling):
    path = str(tiny_model_dirs["llama"])
    options = dict(OPTIONS, async_output_processing=async_output, async_scheduling=async_scheduling)
    cumulative = _stream(LLM(path, **options), _params())
    llm = LLM(path, **options)
    deltas = _stream(llm, [p.clone(output_kind=RequestOutputKind.DELTA) for p in _params()])
    expected = _summary([outputs[-1] for outputs in cumulative.values()])
    assert _summary([_joined(deltas[rid]) for rid in cumulative]) == expected
    assert any(c[2] == "stop" and isinstance(c[3], str) for _, _, cs in expected for c in cs), "no stop string ended one"
    for rid, outputs in deltas.items():
        assert all(o.outputs for o in outputs), "a delta output with nothing new was sent"
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        sizes = [len(c.token_ids) for o in outputs for c in o.outputs]
        assert max(sizes) <= 2, f"request {rid}: a delta held {max(sizes)} tokens (not only the new ones)"
        stops = _params()[int(rid)].stop_strings
        for o in outputs[:-1]:  # (while running: no part of a stop string is sent before it is complete)
            assert not any(stop in c.text for c in o.outputs for stop in stops)
    assert_no_leak(llm.engine)


def test_final_only_kind_gives_one_output(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = _stream(llm, [params])["0"]
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 6


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
