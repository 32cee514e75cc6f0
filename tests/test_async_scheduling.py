"""Async scheduling (on by default on CUDA): step N+1 is scheduled and launched before step N's
sampled tokens reach the host; its inputs take them on the device. Here on CPU (launch finishes the
work, so only the bookkeeping is tested: the stream order that CUDA adds is PyTorch's). Every
output must equal the synchronous engine's, steps must really be left running, and nothing may
leak: with stop tokens and strings ending a request whose next step is already launched, n > 1,
max_tokens, preemption and aborts while a step is in flight, prefill-only readouts, and requests
that need their tokens on the host (grammar, penalties) mixed in."""
import pytest

from conftest import assert_no_leak
from test_async_output import PROMPTS, _params, _summary
from treeserve import LLM, SamplingParams
from treeserve.engine.model_runner import kv_bytes_per_block
from treeserve.engine.step_data import IN_FLIGHT_TOKEN

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)


def _assert_same(got, expected):
    """Tokens, text, finish and stop reasons, ranks equal; logprobs within 1e-4 (a row computed in
    another batch shape rounds differently: a finished request's dropped step changes the batch)."""
    got, expected = _summary(got), _summary(expected)
    strip = [[(p, [c[:4] + (c[4] and [{t: (lp[1], lp[2]) for t, lp in e.items()} for e in c[4]],)
                      for c in cs]) for r, p, cs in rows] for rows in (got, expected)]
    assert strip[0] == strip[1]
    values = [[lp[0] for _, _, cs in rows for c in cs for e in c[4] or () for lp in e.values()] for rows in (got, expected)]
    assert max((abs(a - b) for a, b in zip(*values)), default=0) < 1e-4


def _engines(path, **options):
    sync = LLM(path, async_scheduling=False, **{**OPTIONS, **options})
    overlapped = LLM(path, async_scheduling=True, **{**OPTIONS, **options})
    assert overlapped.engine.pipeline.async_scheduling and not sync.engine.pipeline.async_scheduling
    return sync, overlapped


@pytest.mark.parametrize("family,async_output", [("llama", False), ("qwen2", True)])
def test_async_scheduling_gives_the_synchronous_outputs(tiny_model_dirs, family, async_output):
    sync, overlapped = _engines(str(tiny_model_dirs[family]), async_output_processing=async_output)
    expected = sync.generate(PROMPTS, _params(), use_tqdm=False)
    _assert_same(overlapped.generate(PROMPTS, _params(), use_tqdm=False), expected)
    assert overlapped.engine.stats().num_steps_left_running > 0, "no step was left running"
    assert sync.engine.stats().num_steps_left_running == 0
    assert any(c.finish_reason == "stop" for o in expected for c in o.outputs), "expected a stop string to end some output"
    assert_no_leak(overlapped.engine)


def test_a_stop_token_in_flight_drops_the_extra_step(tiny_model_dirs):
    """The greedy continuation's own token as a stop token: the request ends while its next step
    is already launched; that step's token is dropped and its blocks are freed."""
    sync, overlapped = _engines(str(tiny_model_dirs["llama"]))
    free = sync.generate(["The water is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[4]])
    steps = []
    for llm in (sync, overlapped):
        before = llm.engine.num_steps
        outputs = llm.generate(["The water is"], params, use_tqdm=False)
        steps.append(llm.engine.num_steps - before)
    _assert_same(outputs, sync.generate(["The water is"], params, use_tqdm=False))
    assert outputs[0].outputs[0].finish_reason == "stop" and len(outputs[0].outputs[0].token_ids) == 5
    assert steps == [5, 6], f"steps (sync, async): {steps}; the step launched behind the stop token runs, dropped"
    steps = []
    for llm in (sync, overlapped):  # max_tokens is known ahead: no step is launched past it
        before = llm.engine.num_steps
        llm.generate(["The water is"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        steps.append(llm.engine.num_steps - before)
    assert steps == [5, 5], f"steps (sync, async): {steps}"
    assert_no_leak(overlapped.engine)


def test_host_dependent_requests_run_synchronously_beside_overlapped_ones(tiny_model_dirs):
    sync, overlapped = _engines(str(tiny_model_dirs["llama"]))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    prompts = ["Hello there", "The water is", "x"]
    _assert_same(overlapped.generate(prompts, params, use_tqdm=False), sync.generate(prompts, params, use_tqdm=False))
    assert_no_leak(overlapped.engine)


def test_preemption_and_abort_while_a_step_is_in_flight(tiny_model_dirs):
    """A pool of a few blocks: requests are preempted by the schedule of the step after the one
    they have in flight, and every output still equals the synchronous engine's."""
    probe = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    per_block = kv_bytes_per_block(probe.engine.model, 16, probe.engine.dtype)
    sync, overlapped = _engines(str(tiny_model_dirs["llama"]), kv_cache_memory_bytes=per_block * 8, max_model_len=128)
    assert overlapped.engine.kv.pool.num_blocks == 8
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
    prompts = [f"Request {i} says" for i in range(8)]
    _assert_same(overlapped.generate(prompts, params, use_tqdm=False), sync.generate(prompts, params, use_tqdm=False))
    assert overlapped.engine.scheduler.num_preemptions > 0
    assert_no_leak(overlapped.engine)

    engine = overlapped.engine
    ids = overlapped.get_tokenizer().encode("Hello there")
    engine.add_request("kept", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("gone", ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.pipeline.in_flight is not None
    engine.abort_request("gone")
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.request_id for o in outputs if o.finished] == ["kept"]
    assert len(next(o for o in outputs if o.finished).outputs[0].token_ids) == 6
    assert_no_leak(engine)


def test_readouts_and_the_runner_state_have_no_token_left_in_flight(tiny_model_dirs):
    sync, overlapped = _engines(str(tiny_model_dirs["qwen2"]))
    ids = overlapped.get_tokenizer().encode("Step 1: add the numbers")
    results = []
    for llm in (sync, overlapped):
        engine = llm.engine
        engine.add_request("gen", ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.add_request("read", ids, SamplingParams(), logits_positions=[2, len(ids) - 1])
        outputs = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id] = output
            for state in engine.runner.batch.requests.values():
                known = state.token_ids[:-1] if llm is overlapped else state.token_ids
                assert IN_FLIGHT_TOKEN not in known, "a token older than the last step is still in flight"
        results.append((outputs["gen"].outputs[0].token_ids,
                        {p: t.tolist() for p, t in outputs["read"].prompt_logits.items()}))
        assert_no_leak(engine)
    assert results[0] == results[1]
