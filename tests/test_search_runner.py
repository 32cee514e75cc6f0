"""Search on real (tiny, random) models: the fast runner and the Search-and-Learn reference mode."""
import pytest

from conftest import assert_no_leak
from treeserve import Runtime
from treeserve.errors import ParamError
from treeserve.gateway.pricing import SEARCH_DEFAULTS, search_generation_calls
from treeserve.search.config import SearchConfig
from treeserve.search.reference import HFStepScorer, ReferenceRunner
from treeserve.search.runner import SearchRunner
from treeserve.testing.tiny_models import make_tiny_model

QUESTIONS = ["What is 2 + 3?", "Double seven, then add one.", "How many sides has a square?"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    # a random generator that writes blank-line separated steps and sometimes ends
    steps = {"\n": 5.4, "<|eos|>": 0.5}
    return {"gen": make_tiny_model("llama", root / "gen", seed=5, favour_tokens=steps),
            "prm": make_tiny_model("qwen2", root / "prm", seed=6, hidden_size=96, num_hidden_layers=3,
                                   prm_recipe="rlhflow")}  # (a verifier: runtime/roles.py)


def _runtime(pair, **options):
    options.setdefault("kv_cache_memory_bytes", 8 << 20)
    return Runtime(pair, dtype="float32", device="cpu", max_model_len=384, max_num_batched_tokens=384, **options)


def _config(**changes):
    return SearchConfig(**({"strategy": "beam", "n": 4, "beam_width": 2, "num_iterations": 3, "max_tokens": 24,
                            "temperature": 1.0, "system_prompt": "Solve it.", "seed": 3} | changes))


def _search(rt, config, **options):
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm") if config.uses_verifier else None, **options)
    return runner.run(QUESTIONS, config)


@pytest.mark.parametrize("strategy", ["greedy", "majority", "best_of_n", "weighted_best_of_n", "beam", "dvts"])
def test_every_strategy_runs_and_leaves_no_blocks_behind(pair, strategy):
    rt = _runtime(pair)
    config = _config(strategy=strategy, lookahead=1 if strategy == "dvts" else 0)
    request = {name: getattr(config, name) for name in ("strategy", "n", "num_iterations", "lookahead")}
    results = _search(rt, config)
    assert [r.problem for r in results] == QUESTIONS
    for r in results:
        assert len(r.completions) == (1 if strategy == "greedy" else 4)
        assert len(r.scores) == len(r.completions) and 0 <= r.chosen < len(r.completions)
        assert r.completion_tokens > 0 and r.tree_size >= 1
        # what the gateway reserves for a search's tokens (its budget holds only if this is never passed)
        assert r.completion_tokens <= config.max_tokens * search_generation_calls(request), (r.completion_tokens,
                                                                                            request)
    rt.release_kept()
    for engine in rt.engines.values():
        assert_no_leak(engine)


@pytest.mark.parametrize("question", ["", "  \n "])
def test_an_empty_question_is_refused_offline_too_and_nothing_is_queued(pair, question):
    """`treeserve search` and /v1/search refuse an empty question; SearchRunner.run searched it (the
    model's noise, up to max_tokens per candidate) and returned an answer."""
    rt = _runtime(pair)
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"))
    with pytest.raises(ParamError, match=r"questions\[1\]: the question is empty"):
        runner.run([QUESTIONS[0], question], _config())
    assert runner.num_waiting == runner.num_running == 0  # the first question was not left queued
    with pytest.raises(ParamError, match="question: the question is empty"):
        runner.submit(question, _config())
    assert runner.run(QUESTIONS[:1], _config())[0].completions  # the runner goes on serving
    rt.release_kept()
    for engine in rt.engines.values():
        assert_no_leak(engine)


def test_a_batch_of_questions_is_a_list_or_any_iterable_but_one_string(pair):
    """SearchRunner.run read a generator of questions twice (once to check them): it searched none and
    answered []. One string was searched character by character (a blank one: `questions[4]` is empty)."""
    rt = _runtime(pair)
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"))
    results = runner.run((q for q in QUESTIONS[:2]), _config())
    assert [r.problem for r in results] == QUESTIONS[:2]
    hf = HFStepScorer(str(pair["prm"]), rt.engine("prm").tokenizer)
    for run in (runner.run, ReferenceRunner(rt.engine("gen"), hf).run):
        with pytest.raises(ParamError, match="^questions: must be a list of questions, got str"):
            run(QUESTIONS[0], _config())
        with pytest.raises(ParamError, match=r"questions\[1\]: must be a string, got int"):
            run([QUESTIONS[0], 7], _config())
    assert runner.num_waiting == runner.num_running == 0
    rt.release_kept()
    for engine in rt.engines.values():
        assert_no_leak(engine)


def test_the_gateways_search_defaults_are_the_servers():
    from treeserve.wire.search import SearchRequest

    assert SEARCH_DEFAULTS == {name: SearchRequest.model_fields[name].default for name in SEARCH_DEFAULTS}


def test_results_do_not_depend_on_batching_or_memory(pair):
    one_at_a_time = _search(_runtime(pair), _config(), max_problems_in_flight=1)
    all_together = _search(_runtime(pair, kv_cache_memory_bytes=1 << 20), _config(), max_problems_in_flight=8)
    assert [r.completions for r in one_at_a_time] == [r.completions for r in all_together]
    for x, y in zip(one_at_a_time, all_together):
        for a, b in zip(x.scores, y.scores):
            assert a == pytest.approx(b, abs=1e-4)
    assert max(len(s) for r in one_at_a_time for s in r.scores) >= 2, "beams should grow over several steps"


def test_verifier_scores_match_hugging_face_re_encoding(pair):
    rt = _runtime(pair)
    results = _search(rt, _config())
    items = [(r.problem, [s.strip() for s in c.split("\n\n") if s.strip()]) for r in results for c in r.completions]
    items = [i for i in items if i[1]]
    hf = HFStepScorer(str(pair["prm"]), rt.engine("prm").tokenizer)
    ours = [s for r in results for c, s in zip(r.completions, r.scores) if s]
    reference = hf.score_many(items)
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference):
        assert a == pytest.approx(b, abs=1e-4)


def test_reference_mode_runs_the_same_strategy_and_samples_to_the_end_at_max_depth(pair):
    rt = _runtime(pair)
    hf = HFStepScorer(str(pair["prm"]), rt.engine("prm").tokenizer)
    results = ReferenceRunner(rt.engine("gen"), hf, batch_size=2).run(QUESTIONS, _config())
    assert [r.problem for r in results] == QUESTIONS
    assert all(len(r.completions) == 4 for r in results)
    assert hf.num_tokens_computed > 0
    assert_no_leak(rt.engine("gen"))


def test_evaluate_records_the_aggregation_the_verifier_declared(pair, tmp_path):
    """`evaluate()` called directly with `agg_strategy` left out folded step scores with the verifier's
    declared aggregation (the runner names it) but its summary recorded `agg_strategy: null`."""
    import json
    import shutil

    from treeserve.search.evaluate import evaluate

    declared = tmp_path / "prm"
    shutil.copytree(pair["prm"], declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps(config | {"prm_aggregation": "min"}))
    rt = _runtime({"gen": pair["gen"], "prm": str(declared)})
    rows = [{"problem": q, "answer": "5"} for q in QUESTIONS[:2]]
    summary = evaluate(rows, _config(strategy="best_of_n"), SearchRunner(rt.engine("gen"), rt.scorer("prm")).run,
                       tmp_path / "out")
    assert summary["config"]["agg_strategy"] == "min"
    records = [json.loads(line) for line in (tmp_path / "out" / "best_of_n_n4.jsonl").read_text().splitlines()]
    assert [r["agg_strategy"] for r in records] == ["min", "min"]
    assert all(r["agg_scores"] == [min(s) if s else 0.0 for s in r["scores"]] for r in records)


def test_a_verifier_strategy_without_a_verifier_is_refused(pair):
    rt = _runtime(pair)
    with pytest.raises(ValueError, match="verifier"):
        SearchRunner(rt.engine("gen"), None).run(QUESTIONS, _config())


def test_a_search_that_fails_midway_leaves_no_request_claim_or_block_behind(pair, monkeypatch):
    rt = _runtime(pair)
    scorer = rt.scorer("prm")
    runner = SearchRunner(rt.engine("gen"), scorer, max_problems_in_flight=3)
    collect, seen = scorer._on_output, []

    def fail_on_the_third_output(output):
        seen.append(scorer.has_pending)
        if len(seen) == 3:
            raise KeyboardInterrupt("stop")
        return collect(output)

    monkeypatch.setattr(scorer, "_on_output", fail_on_the_third_output)
    with pytest.raises(KeyboardInterrupt):
        runner.run(QUESTIONS, _config())
    assert seen[-1], "the failure should come while scoring requests are in flight"
    assert not scorer.has_pending and not scorer._claimed
    monkeypatch.setattr(scorer, "_on_output", collect)
    rt.release_kept()
    for engine in rt.engines.values():
        assert_no_leak(engine)
    assert [r.problem for r in runner.run(QUESTIONS, _config())] == QUESTIONS  # and it searches again


def test_a_failure_resuming_one_problem_fails_that_problem_only(pair, monkeypatch):
    """An error handing a problem its action's result (a progress callback, say) fails that problem
    and frees its requests; the other problems and the loop go on."""
    rt = _runtime(pair)
    runner = SearchRunner(rt.engine("gen"), rt.scorer("prm"), max_problems_in_flight=3)
    resume, failed = runner._action_result, []

    def fail_once_for_the_first(handle):
        if handle.question == QUESTIONS[0] and not failed:
            failed.append(handle)
            raise RuntimeError("a callback broke")
        return resume(handle)
    monkeypatch.setattr(runner, "_action_result", fail_once_for_the_first)
    handles = [runner.submit(q, _config()) for q in QUESTIONS]
    rt.loop.run_until(lambda: all(h.done for h in handles))
    assert str(handles[0].error) == "a callback broke" and handles[0].result is None
    assert all(h.result is not None and h.error is None for h in handles[1:])
    rt.release_kept()
    for engine in rt.engines.values():
        assert_no_leak(engine)


@pytest.mark.parametrize("strategy, verifier_len", [("beam", 96), ("best_of_n", 64)])
def test_long_searches_score_what_the_verifier_can_read_in_both_modes(pair, strategy, verifier_len):
    """A verifier shorter than the conversations: the steps past its length score 0 and the
    search goes on; the reference mode reads the same prefix."""
    rt = _runtime(pair)
    prm = rt.engine("prm")
    prm.max_model_len = verifier_len  # shorter than many of the conversations
    results = _search(rt, _config(strategy=strategy, max_tokens=64))
    assert rt.scorer("prm").num_unjudged_steps > 0
    items = [(r.problem, [s.strip() for s in c.split("\n\n") if s.strip()]) for r in results for c in r.completions]
    hf = HFStepScorer(str(pair["prm"]), prm.tokenizer, max_len=prm.max_model_len)
    for (question, steps), ours, reference in zip(items, [s for r in results for s in r.scores], hf.score_many(items)):
        if steps:
            assert ours == pytest.approx(reference, abs=1e-4)
    if strategy == "best_of_n":  # whole completions: steps scored, then steps past the verifier's length
        assert any(s[0] > 0 and s[-1] == 0 for r in results for s in r.scores if s)
    rt.release_kept()
    assert_no_leak(prm)
