"""Request fields declared once: the OpenAI request models carry SamplingParams's fields as
wire/sampling_fields.py classifies them, every one of them arrives in SamplingParams, and a search
body's fields arrive in SearchConfig."""
import dataclasses

import pytest

from treeserve.sampling_params import SamplingParams
from treeserve.search.config import SearchConfig
from treeserve.speculative_config import SpeculativeConfig
from treeserve.wire.chat_completions import ChatCompletionRequest
from treeserve.wire.completions import CompletionRequest
from treeserve.wire.sampling_fields import AS_DECLARED, COMPUTED, MODEL_DEFAULTED, OFFLINE_ONLY, carried
from treeserve.wire.search import SearchRequest

# A value other than SamplingParams's default for each carried field (a new carried field needs one here).
WIRE_VALUES = {"n": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "presence_penalty": 0.5,
               "frequency_penalty": -0.5, "repetition_penalty": 1.2, "seed": 11, "min_tokens": 2, "stop": ["##"],
               "stop_token_ids": [5, 6], "include_stop_str_in_output": True, "ignore_eos": True,
               "skip_special_tokens": False, "bad_words": ["foo"], "allowed_token_ids": [3, 4],
               "truncate_prompt_tokens": 5}
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                  "max_tokens": 99}
BODIES = [(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
          (CompletionRequest, {"prompt": "hi"})]


def _init_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def test_every_sampling_params_field_is_classified_once():
    """A new SamplingParams field must be given a place: carried by the wire, or computed by each API."""
    lists, fields = MODEL_DEFAULTED + AS_DECLARED + COMPUTED + OFFLINE_ONLY, set(_init_fields())
    assert sorted(lists) == sorted(set(lists)), "a field is in two lists of wire/sampling_fields.py"
    assert set(lists) == fields, f"unclassified: {fields - set(lists)}; not SamplingParams fields: {set(lists) - fields}"


def test_carried_fields_have_a_default_and_a_test_value():
    assert all(f.default is not dataclasses.MISSING for f in carried())
    assert set(WIRE_VALUES) == {f.name for f in carried()}
    assert all(WIRE_VALUES[f.name] != f.default for f in carried())


@pytest.mark.parametrize("model, body", BODIES)
def test_every_carried_field_reaches_sampling_params(model, body):
    request = model.model_validate({"model": "m", **body, **WIRE_VALUES})
    params = request.sampling_params(MODEL_DEFAULTS, max_tokens=8, logprobs=None)
    assert {name: getattr(params, name) for name in WIRE_VALUES} == WIRE_VALUES


@pytest.mark.parametrize("model, body", BODIES)
def test_model_defaulted_fields_left_out_take_the_models_then_sampling_params_defaults(model, body):
    request = model.model_validate({"model": "m", **body})
    assert all(model.model_fields[name].default is None for name in MODEL_DEFAULTED)
    params = request.sampling_params(MODEL_DEFAULTS, max_tokens=8, logprobs=None)
    assert {name: getattr(params, name) for name in MODEL_DEFAULTED} == {n: MODEL_DEFAULTS[n] for n in MODEL_DEFAULTED}
    assert params.max_tokens == 8  # the model's max_new_tokens is the server's business, not the body's
    plain = request.sampling_params({}, max_tokens=8, logprobs=None)
    assert plain == SamplingParams(max_tokens=8)


@pytest.mark.parametrize("model, body", BODIES)
def test_as_declared_fields_keep_sampling_params_defaults_on_the_wire(model, body):
    request = model.model_validate({"model": "m", **body})
    declared = {f.name: f.default for f in carried() if f.name in AS_DECLARED}
    assert {name: getattr(request, name) for name in declared} == declared


# ---- search ---------------------------------------------------------------------------------

def test_every_search_config_field_is_on_the_search_request():
    from treeserve.server.serving_search import SERVER_CHOSEN
    missing = [f.name for f in dataclasses.fields(SearchConfig) if f.name not in SearchRequest.model_fields]
    assert not missing, f"SearchConfig fields a /v1/search body cannot set: {missing}"
    for f in dataclasses.fields(SearchConfig):
        wire_default = SearchRequest.model_fields[f.name].default
        assert wire_default == (None if f.name in SERVER_CHOSEN else f.default), f.name


def test_search_config_copies_every_search_field():
    from treeserve.server.serving_search import SERVER_CHOSEN, search_config
    values = {"strategy": "dvts", "n": 8, "num_iterations": 5, "lookahead": 1, "temperature": 0.3, "top_p": 0.7,
              "max_tokens": 64, "filter_duplicates": True, "sort_completed": True, "eos_sampling_at_max_depth": True,
              "seed": 9, "speculative_config": {"method": "suffix", "num_speculative_tokens": 3}}
    assert set(values) == {f.name for f in dataclasses.fields(SearchConfig)} - set(SERVER_CHOSEN)
    config = search_config(SearchRequest(question="q", **values), "sys", "min")
    expected = values | {"speculative_config": SpeculativeConfig.of(values["speculative_config"])}  # validated
    assert {name: getattr(config, name) for name in values} == expected
    assert (config.beam_width, config.agg_strategy, config.system_prompt) == (4, "min", "sys")
    chosen = search_config(SearchRequest(question="q", n=8, beam_width=2, agg_strategy="prod"), None)
    assert (chosen.beam_width, chosen.agg_strategy, chosen.system_prompt) == (2, "prod", None)
