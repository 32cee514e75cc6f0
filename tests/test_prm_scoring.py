"""PRM step scores against HF transformers, the score cache, and incremental scoring through kept KV."""
import pytest
import torch
import transformers

from conftest import assert_no_leak
from treeserve.config import EngineConfig
from treeserve.engine.llm_engine import LLMEngine
from treeserve.errors import ParamError
from treeserve.runtime.prm_recipes import RECIPES, build_many
from treeserve.runtime.scorer import UNJUDGED_SCORE, StepScorer

QUESTION = "What is the total of two and three, times four?"
STEPS = ["Step 1: two plus three is five.", "Step 2: five times four is twenty.",
         "Step 3: so the answer is boxed twenty.", "Step 4: check: twenty over four is five."]


@pytest.fixture(scope="module")
def prm_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen2"]


def _engine(path, **options):
    return LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                  kv_cache_memory_bytes=options.pop("kv", 8 << 20), **options))


@pytest.mark.parametrize("recipe", sorted(r for r in RECIPES if RECIPES[r].head == "lm"  # heads: test_reward_heads
                                            and not RECIPES[r].reads_step_tokens))  # likelihood: below
def test_scores_match_hf(prm_dir, recipe):
    engine = _engine(prm_dir)
    scorer = StepScorer(engine, recipe)
    hf = transformers.AutoModelForCausalLM.from_pretrained(prm_dir, dtype=torch.float32).eval()
    ours = scorer.score_steps(QUESTION, STEPS)
    prm_input = RECIPES[recipe].build(engine.tokenizer, QUESTION, STEPS)
    with torch.no_grad():
        logits = hf(torch.tensor([prm_input.token_ids])).logits[0]
    good, bad = scorer.candidates
    ref = [float(torch.softmax(logits[p, [good, bad]], dim=-1)[0]) for p in prm_input.verdict_positions]
    assert len(ours) == len(STEPS)
    assert ours == pytest.approx(ref, abs=1e-4)
    scorer.release_all()
    assert_no_leak(engine)


@pytest.mark.parametrize("recipe", sorted(r for r in RECIPES if RECIPES[r].head == "lm") + ["value-head"])
def test_inputs_built_together_equal_those_built_one_by_one(prm_dir, recipe):
    """A scorer builds a submit's inputs together (their texts tokenized in one call)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(prm_dir)
    items = [(QUESTION, STEPS[:k]) for k in range(1, 5)] + [("What is four?", STEPS[1:3]), (QUESTION, STEPS[:2])]
    one_by_one = [RECIPES[recipe].build(tokenizer, question, steps) for question, steps in items]
    assert build_many(RECIPES[recipe], tokenizer, items) == one_by_one
    if RECIPES[recipe].head == "lm":
        scorer = StepScorer(_engine(prm_dir), recipe)
        assert scorer.build(*items[1]) == one_by_one[1]  # remembered, then the rest built together
        assert scorer.build_many(items) == one_by_one


def _likelihood_reference(path, tokenizer, question, steps) -> list[float]:
    """Each step's lowest token probability under HF, its end read as the delimiter's first token
    or the end of the turn (found here from the text's character offsets, apart from the recipe)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    bounds = []
    for step in steps:
        bounds.append((len(text), len(text) + len(step)))
        text += step + "\n\n"
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoding["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    scores = []
    for start, end in bounds:
        inside = [i for i, (a, _) in enumerate(encoding["offset_mapping"]) if start <= a < end]
        ender = next(i for i, (a, _) in enumerate(encoding["offset_mapping"]) if a == end)
        step_probs = [float(probs[i - 1, ids[i]]) for i in inside]
        step_probs.append(float(probs[ender - 1, ids[ender]] + probs[ender - 1, tokenizer.eos_token_id]))
        scores.append(min(step_probs))
    return scores


def test_likelihood_scores_match_hf_scored_at_once_step_by_step_and_by_the_reference_mode(prm_dir):
    """`lm-likelihood`: a step's score is its lowest token probability (its end: delimiter or end of
    turn). Scored at once, one step after another (a kept conversation is forked only up to the step
    before: step k's first read is at step k-1's last token) and by the HF reference mode, alike."""
    from treeserve.search.reference import HFStepScorer

    engine = _engine(prm_dir)
    expected = _likelihood_reference(prm_dir, engine.tokenizer, QUESTION, STEPS)
    assert StepScorer(_engine(prm_dir), "lm-likelihood").score_steps(QUESTION, STEPS) == pytest.approx(expected, abs=1e-5)
    scorer = StepScorer(engine, "lm-likelihood")
    for count in range(1, len(STEPS) + 1):
        assert scorer.score_steps(QUESTION, STEPS[:count]) == pytest.approx(expected[:count], abs=1e-5)
    assert scorer.score_cache.get((QUESTION, *STEPS[:2])) == pytest.approx(expected[1], abs=1e-5)
    assert len(set(expected)) == len(expected) and all(0 < x < 1 for x in expected)
    reference = HFStepScorer(str(prm_dir), engine.tokenizer, "lm-likelihood").score_many([(QUESTION, STEPS)])
    assert reference[0] == pytest.approx(expected, abs=1e-5)
    scorer.release_all()
    assert_no_leak(engine)


def test_likelihood_recipe_refuses_a_delimiter_that_merges_with_the_step(prm_dir):
    from treeserve.runtime.prm_recipes import LikelihoodRecipe

    tokenizer = _engine(prm_dir).tokenizer
    with pytest.raises(ValueError, match="does not start a token of its own"):
        LikelihoodRecipe(step_delimiter="s").build(tokenizer, QUESTION, ["so the answer is twenty", "done"])


def test_repeat_is_free_and_extension_computes_only_new_tokens(prm_dir):
    engine = _engine(prm_dir)
    scorer = StepScorer(engine)
    recipe = scorer.recipe
    first = scorer.score_steps(QUESTION, STEPS[:2])
    steps_before, computed_before = engine.num_steps, engine.num_tokens_computed
    assert scorer.score_steps(QUESTION, STEPS[:2]) == first
    assert (engine.num_steps, engine.num_tokens_computed) == (steps_before, computed_before)
    third = scorer.score_steps(QUESTION, STEPS[:3])
    new_tokens = len(recipe.build(engine.tokenizer, QUESTION, STEPS[:3]).token_ids) - \
        len(recipe.build(engine.tokenizer, QUESTION, STEPS[:2]).token_ids)
    assert engine.num_tokens_computed - computed_before == new_tokens
    assert third[:2] == first
    fresh = StepScorer(_engine(prm_dir)).score_steps(QUESTION, STEPS[:3])
    assert third == pytest.approx(fresh, abs=1e-5)
    scorer.release_all()
    assert_no_leak(engine)


def test_batched_scoring_and_memory_pressure(prm_dir):
    engine = _engine(prm_dir, max_model_len=256)
    small = _engine(prm_dir, kv=20 * _block_bytes(engine), max_model_len=256)
    items = [(f"{QUESTION} variant {i}", STEPS[: 1 + i % 4]) for i in range(12)]
    reference = _flat(StepScorer(engine).score_many(items))
    tight = StepScorer(small)
    assert _flat(tight.score_many(items)) == pytest.approx(reference, abs=1e-5)
    assert len(small.retained) < len(items)  # kept sequences were released to make room
    computed = small.num_tokens_computed
    assert _flat(tight.score_many(items)) == pytest.approx(reference, abs=1e-5)
    assert small.num_tokens_computed == computed  # all cached now
    tight.release_all()
    assert_no_leak(small)


def _flat(nested):
    return [x for row in nested for x in row]


def _block_bytes(engine):
    from treeserve.engine.model_runner import kv_bytes_per_block

    return kv_bytes_per_block(engine.model, engine.config.block_size, engine.dtype)


@pytest.mark.parametrize("block_size", [4, 16])
def test_siblings_scored_together_get_every_verdict(prm_dir, block_size):
    """Two step lists that share an unscored first step, in one batch: the second waits for the
    first to compute the shared prefix, and its cache hit must stop short of the verdict it needs."""
    items = [(QUESTION, STEPS[:1] + [s]) for s in STEPS[1:]]
    together = StepScorer(_engine(prm_dir, block_size=block_size)).score_many(items)
    alone = [StepScorer(_engine(prm_dir, block_size=block_size)).score_steps(q, s) for q, s in items]
    assert [s for scores in together for s in scores] == pytest.approx([s for scores in alone for s in scores], abs=1e-5)


def test_chat_steps_recipe_reads_the_solution_as_the_generator_wrote_it():
    from treeserve.tasks.arithmetic import parse_problem
    from treeserve.tasks.tokenizer import train_task_tokenizer

    tokenizer = train_task_tokenizer()
    problem = parse_problem("Start with 40 and work modulo 100. Step 1: + 5. Step 2: - 3. What is the result?")
    steps = problem.steps()
    built = RECIPES["chat-steps"].build(tokenizer, problem.text, steps)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": problem.text}], tokenize=False,
                                           add_generation_prompt=True)
    assert tokenizer.decode(built.token_ids) == prompt + "\n\n".join(steps) + "\n\n"
    assert built.verdict_positions[-1] == len(built.token_ids) - 1
    for position, step in zip(built.verdict_positions, steps):  # each verdict follows its step's delimiter
        assert tokenizer.decode(built.token_ids[:position + 1]).endswith(step + "\n\n")
    shorter = RECIPES["chat-steps"].build(tokenizer, problem.text, steps[:2])
    assert built.token_ids[: len(shorter.token_ids)] == shorter.token_ids  # scoring step k+1 extends step k


def test_a_model_directory_names_its_recipe(tmp_path):
    import json

    from treeserve.runtime.prm_recipes import DEFAULT_RECIPE, declared_recipe

    assert declared_recipe(tmp_path) == DEFAULT_RECIPE  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert declared_recipe(tmp_path) == DEFAULT_RECIPE
    (tmp_path / "config.json").write_text(json.dumps({"prm_recipe": "chat-steps"}))
    assert declared_recipe(tmp_path) == "chat-steps"
    (tmp_path / "config.json").write_text(json.dumps({"prm_recipe": "nonsense"}))
    with pytest.raises(ValueError, match="prm_recipe"):
        declared_recipe(tmp_path)


def test_a_model_directory_names_its_aggregation_and_search_requests_default_to_it(tmp_path):
    import json

    from treeserve.search.config import declared_aggregation
    from treeserve.wire.search import SearchRequest
    from treeserve.server.serving_search import search_config

    assert declared_aggregation(tmp_path) == "last"  # no config.json: Search-and-Learn's default
    (tmp_path / "config.json").write_text(json.dumps({"prm_aggregation": "min"}))
    assert declared_aggregation(tmp_path) == "min"
    (tmp_path / "config.json").write_text(json.dumps({"prm_aggregation": "mean"}))
    with pytest.raises(ValueError, match="prm_aggregation 'mean'; known: last, min, prod"):
        declared_aggregation(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert declared_aggregation(tmp_path) == "last"  # a config.json that names none
    assert search_config(SearchRequest(question="q"), None, "min").agg_strategy == "min"
    assert search_config(SearchRequest(question="q", agg_strategy="prod"), None, "min").agg_strategy == "prod"


def test_runtime_uses_the_declared_recipe_and_aggregation_unless_told_otherwise(prm_dir, tmp_path):
    import json
    import shutil

    from treeserve import Runtime

    declared = tmp_path / "prm"
    shutil.copytree(prm_dir, declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**config, "prm_recipe": "chat-steps", "prm_aggregation": "min"}))
    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    rt = Runtime({"plain": str(prm_dir), "prm": str(declared)}, **options)
    # a plain language model that declares no recipe is no verifier (it was read as RLHFlow's, in silence)
    assert rt.recipes == {"prm": "chat-steps"}
    assert rt.scorer("prm").recipe.name == "chat-steps"
    with pytest.raises(ParamError, match="'plain' is not served as a verifier .* recipes={'plain': None}"):
        rt.score_steps("plain", QUESTION, STEPS)
    rt.close()
    rt = Runtime({"plain": str(prm_dir), "prm": str(declared)}, recipes={"plain": None}, **options)
    assert rt.recipes == {"plain": "rlhflow", "prm": "chat-steps"}  # named a verifier: RLHFlow's by default
    rt.close()
    rt = Runtime({"prm": str(declared)}, recipes={"prm": "math-shepherd"}, **options)
    assert rt.recipes == {"prm": "math-shepherd"}
    rt.close()


def test_a_conversation_longer_than_the_verifier_reads_scores_unjudged_and_leaks_nothing(prm_dir):
    recipe = RECIPES["math-shepherd"]
    probe = _engine(prm_dir)
    two, three = (len(recipe.build(probe.tokenizer, QUESTION, STEPS[:k]).token_ids) for k in (2, 3))
    engine = _engine(prm_dir, max_model_len=(two + three) // 2)
    scorer = StepScorer(engine, "math-shepherd")
    first_two = scorer.score_steps(QUESTION, STEPS[:2])
    assert scorer.score_steps(QUESTION, STEPS[:3]) == first_two + [UNJUDGED_SCORE]
    assert scorer.score_many([(QUESTION, STEPS[:4]), (QUESTION, STEPS[:1])]) == [
        first_two + [UNJUDGED_SCORE] * 2, first_two[:1]]
    assert scorer.num_unjudged_steps == 2
    # scored at once, the steps that fit are read and the rest are not
    fresh = StepScorer(engine, "math-shepherd")
    assert fresh.score_steps(QUESTION, STEPS) == pytest.approx(first_two + [UNJUDGED_SCORE] * 2, abs=1e-5)
    with pytest.raises(ValueError, match="maximum model length"):
        fresh.require_readable(QUESTION, STEPS[:3])
    fresh.require_readable(QUESTION, STEPS[:2])
    for s in (scorer, fresh):
        s.release_all()
    assert_no_leak(engine)


def test_completions_sharing_steps_scored_together_compute_what_they_would_one_after_another(prm_dir):
    """Best-of-N scores whole completions at once: a shared step is scored by one request only,
    so the others reuse its KV rather than recomputing up to their first verdict."""
    first, second = (QUESTION, STEPS[:3]), (QUESTION, STEPS[:2] + [STEPS[3]])
    apart = _engine(prm_dir)
    scorer = StepScorer(apart)
    expected = scorer.score_steps(*first), scorer.score_steps(*second)
    together = _engine(prm_dir)
    scorer = StepScorer(together)
    scores = scorer.score_many([first, second])
    for got, want in zip(scores, expected):
        assert got == pytest.approx(want, abs=1e-5)
    assert together.num_tokens_computed == apart.num_tokens_computed
    scorer.release_all()
    assert_no_leak(together)


def test_a_tiny_score_cache_evicts_but_every_ticket_gets_its_scores(prm_dir):
    """The score cache is bounded by bytes: entries go while scores are in flight, and the ticket
    still holds every score it asked for (it keeps its own copy as they arrive)."""
    items = [(f"{QUESTION} variant {i}", STEPS[: 1 + i % 4]) for i in range(6)]
    reference = StepScorer(_engine(prm_dir)).score_many(items)
    tiny = StepScorer(_engine(prm_dir), score_cache_bytes=600)
    assert _flat(tiny.score_many(items)) == pytest.approx(_flat(reference), abs=1e-5)
    assert tiny.score_cache.num_evictions > 0 and tiny.score_cache.nbytes <= 600


def test_candidates_scoring_below_their_best_sibling_are_released_first(prm_dir):
    """Of the candidates extending one parent, a search extends the best scored: the others go to
    the front of the release order, the scorer's and the engine's (which frees kept KV in that
    order when its pool runs short), so the best candidate's conversation is kept the longest."""
    engine = _engine(prm_dir)
    scorer = StepScorer(engine)
    items = [(QUESTION, [STEPS[0], step]) for step in STEPS[1:]]
    scores = [row[-1] for row in scorer.score_many(items)]
    keys = [(QUESTION, *steps) for _, steps in items]
    best = keys[max(range(len(keys)), key=scores.__getitem__)]
    assert len(set(scores)) == len(scores) and all(key in scorer.kept for key in keys)
    assert list(scorer.kept)[-1] == best
    best_id = scorer.kept.get(best)
    for _ in range(len(keys) - 1):
        assert engine.retained.release_oldest()
    assert best_id in engine.retained and len(engine.retained) == 1
    scorer.release_all()
    assert_no_leak(engine)


def test_a_kept_conversation_whose_score_was_evicted_is_not_forked_past_the_verdict(prm_dir):
    """Step 1's KV is kept but its score left the cache: scoring steps 1..2 must compute step 1's
    verdict again, so it cannot fork the kept conversation that already holds that position."""
    reference = StepScorer(_engine(prm_dir)).score_steps(QUESTION, STEPS[:2])
    engine = _engine(prm_dir)
    scorer = StepScorer(engine)
    scorer.score_steps(QUESTION, STEPS[:1])
    assert (QUESTION, STEPS[0]) in scorer.kept
    scorer.score_cache.clear()  # the bounded cache evicted step 1's score
    assert scorer.score_steps(QUESTION, STEPS[:2]) == pytest.approx(reference, abs=1e-5)
    scorer.release_all()
    assert_no_leak(engine)


def test_a_ticket_for_steps_in_flight_asks_again_for_a_score_evicted_meanwhile(prm_dir):
    """A request in flight reads only the steps it claimed (step 2; step 1 was cached). When step
    1's score is evicted before a second ticket for the same steps arrives, that ticket asks for
    step 1 itself instead of waiting on a request that will never read it."""
    reference = StepScorer(_engine(prm_dir)).score_steps(QUESTION, STEPS[:2])
    engine = _engine(prm_dir)
    scorer = StepScorer(engine)
    scorer.score_steps(QUESTION, STEPS[:1])
    first = scorer.submit([(QUESTION, STEPS[:2])])
    scorer.score_cache.clear()
    second = scorer.submit([(QUESTION, STEPS[:2])])
    scorer.loop.run_until(lambda: first.ready and second.ready)
    assert first.results()[0] == pytest.approx(reference, abs=1e-5)
    assert second.results()[0] == pytest.approx(reference, abs=1e-5)
    scorer.release_all()
    assert_no_leak(engine)
