"""Speculation on the families the dense tests leave out: Phi-3 (LongRoPE), Gemma 1/2/3 (sliding
windows whose blocks are freed behind them while drafts come and go) and the mixture-of-experts
kin. Greedy outputs with n-gram drafts, a draft model (the target itself: every draft kept) and a
random EAGLE-3 head equal those without speculation, twice (the second time from the prefix cache),
and nothing is left held."""
import pytest

from conftest import assert_no_leak
from test_spec_decode import _llm, _tokens, draft_always
from treeserve.testing.tiny_models import GEMMA_FAMILIES, MOE_FAMILIES, make_tiny_eagle_head, make_tiny_model

OTHER_FAMILIES = ("phi3",) + GEMMA_FAMILIES + MOE_FAMILIES


@pytest.fixture(scope="module", params=OTHER_FAMILIES)
def target(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "model", seed=3)


def _configs(target, tmp_path):
    head = make_tiny_eagle_head("eagle3", target, tmp_path / "head")
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4},
            "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}}


def test_greedy_tokens_equal_decoding_without_speculation(target, tmp_path):
    expected = _tokens(_llm(target))
    for method, config in _configs(target, tmp_path).items():
        llm = draft_always(_llm(target, speculative_config=config))
        assert _tokens(llm) == expected, method
        assert _tokens(llm) == expected, method  # prefix-cache hits
        stats = llm.engine.stats()
        assert stats.spec_decode_num_draft_tokens > 0, method
        if method == "draft_model":  # the target drafting for itself: every draft is kept
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        assert_no_leak(llm.engine)

