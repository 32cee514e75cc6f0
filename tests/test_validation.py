"""Bad input raises ValueError naming the parameter, before anything is scheduled."""
import pytest

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.config import EngineConfig
from treeserve.errors import ParamError
from treeserve.runtime.runtime import Runtime
from treeserve.search.config import SearchConfig
from treeserve.wire.errors import from_value_error


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=-2), "logprobs"),  # (-1 is vLLM's whole vocabulary)
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    # (each was taken: "no" is truthy, so ignore_eos="no" ignored EOS; an int was a TypeError from list())
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(skip_special_tokens="false"), "skip_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(seed="x"), "seed"),
    (dict(seed=2 ** 64), "seed"),  # (accepted, it failed at the first draw: "Overflow when unpacking long long")
    (dict(seed=-2 ** 63 - 1), "seed"),
])
def test_sampling_params_reject_bad_values(kwargs, name):
    with pytest.raises(ParamError, match=f"^{name}:") as error:
        SamplingParams(**kwargs)
    assert error.value.param == name


@pytest.mark.parametrize("make, name", [
    (lambda: EngineConfig(model="m", block_size=0), "block_size"),
    (lambda: EngineConfig(model="m", dtype="int8"), "dtype"),
    (lambda: EngineConfig(model="m", seed="0"), "seed"),  # (a TypeError from int() at load before)
    (lambda: EngineConfig(model="m", seed=1.5), "seed"),
    (lambda: EngineConfig(model="m", seed=True), "seed"),
    (lambda: SearchConfig(strategy="mcts"), "strategy"),
    (lambda: SearchConfig(strategy="dvts", n=3, beam_width=2), "beam_width"),
    (lambda: SearchConfig(strategy="beam", n=1, beam_width=2), "beam_width"),  # (beam search takes n=3: S&L's)
    # (before any model loads; each was dropped: fractions of a shared arena, a recipe for no model)
    (lambda: Runtime({"gen": "g", "prm": "p"}, kv_fractions={"gen": 0.5, "prm": 0.5}), "kv_fractions"),
    (lambda: Runtime({"gen": "g", "prm": "p"}, recipes={"zzz": "rlhflow"}), "recipes"),
    (lambda: Runtime({"gen": "g", "prm": "p"}, recipes={"prm": "bogus"}), "recipes"),
    # (an AttributeError on str.items, and EngineConfig's TypeError, before; LLM(...) named both)
    (lambda: Runtime("builtin:arith-gen"), "models"),
    (lambda: Runtime({"gen": "g"}, max_num_sequences=8), "max_num_sequences"),
    (lambda: Runtime({"gen": "g"}, enable_lora=True), "enable_lora"),
])
def test_settings_errors_carry_their_parameter(make, name):
    with pytest.raises(ParamError, match=f"^{name}: ") as error:
        make()
    assert error.value.param == name and isinstance(error.value, ValueError)


def test_a_numpy_integer_seed_is_taken_as_int_took_it():
    """A seed from numpy (a sweep's np.arange, np.random's draws) went through int() at load; the
    check that made a bad seed a ParamError must not refuse it."""
    import numpy as np

    assert EngineConfig(model="m", seed=np.int64(7)).seed == 7
    assert type(EngineConfig(model="m", seed=np.uint32(3)).seed) is int


def test_the_server_takes_the_parameter_from_a_param_error_and_never_from_the_text():
    named = from_value_error(ParamError("top_p", "must be in (0, 1], got 7.5"))
    assert (named.status, named.message, named.param) == (400, "top_p: must be in (0, 1], got 7.5", "top_p")
    plain = from_value_error(ValueError("top_p: must be in (0, 1], got 7.5"))
    assert (plain.message, plain.param) == ("top_p: must be in (0, 1], got 7.5", None)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=64)


@pytest.mark.parametrize("prompts", [
    [""],
    [[]],
    ["ok", "word " * 200],
    [[1, 2, 10**9]],
])
def test_bad_prompts_rejected_before_scheduling(llm, prompts):
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.scheduler.has_unfinished()
    assert_no_leak(llm.engine)
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_prompt_past_the_context_is_openais_overflow(llm):
    from treeserve.errors import ContextLengthError

    with pytest.raises(ContextLengthError, match=r"^prompt: This model's maximum context length is 64 tokens\. "
                       r"However, you requested 65 tokens \(64 in the messages, 1 in the completion\)") as raised:
        llm.generate([[1] * 64], SamplingParams(max_tokens=4), use_tqdm=False)
    assert raised.value.param == "prompt" and raised.value.code == "context_length_exceeded"
    assert_no_leak(llm.engine)


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="^sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_max_tokens_is_clipped_to_context(llm):
    out = llm.generate("word " * 10, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("options, name", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=0), "block_size"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(kv_cache_memory_bytes=1024, max_model_len=64), "kv_cache_memory_bytes"),
    (dict(max_model_len=10**6), "max_model_len"),
])
def test_engine_options_rejected(llama_dir, options, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        LLM(str(llama_dir), **{"device": "cpu", **options})
