"""Each strategy's semantics, pinned with a scripted generator and verifier (no models)."""
import pytest

from treeserve.search.config import SearchConfig
from treeserve.search.progress import SearchProgress
from treeserve.search.strategies import run_strategy
from treeserve.search.tree import Sample, Score, Step, aggregate


class Script:
    """A fake generator and verifier. `steps(beam_text, j)` gives continuation j of a beam as
    (text, finish); `score(step_text)` gives the verifier's score for one step."""

    def __init__(self, steps, score):
        self.steps, self.score = steps, score
        self.samples: list[Sample] = []
        self.replies: list[list[list[Step]]] = []  # each Sample's continuations, as the runner hands them back

    def _step(self, text, j):
        step_text, finish = self.steps(text, j)
        return Step(step_text, [0], finish)

    def run(self, config, question="q", problem_index=0):
        strategy = run_strategy(question, config, problem_index)
        reply = None
        while True:
            try:
                action = strategy.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(action, Sample):
                self.samples.append(action)
                reply = [[self._step(b.text, j) for j in range(c)]
                         for b, c in zip(action.beams, action.counts)]
                self.replies.append(reply)
            else:
                assert isinstance(action, Score)
                reply = [[self.score(s) for s in t.split("\n\n") if s.strip()] for t in action.texts]


def beam_config(**changes):
    return SearchConfig(**({"strategy": "beam", "n": 4, "beam_width": 2, "num_iterations": 3, "seed": 0} | changes))


def test_beam_search_keeps_the_best_n_over_m_and_expands_each_m_times():
    # continuation j of a beam appends letter j; a step's score is its letter's value
    values = {"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.7}
    script = Script(lambda text, j: ("abcd"[j] + "\n\n", "step"), lambda s: values[s])
    result = script.run(beam_config())
    first, second, third = script.samples
    assert first.counts == [4] and len(first.beams) == 1
    # 4 candidates a, b, c, d from the root: b (0.9) and d (0.7) survive, in their original order
    assert [b.text for b in second.beams] == ["b\n\n", "d\n\n"] and second.counts == [2, 2]
    # second level, round-robin order: b+a, d+a, b+b, d+b -> best two are b+b (0.9), d+b (0.9)
    assert [b.text for b in third.beams] == ["b\n\nb\n\n", "d\n\nb\n\n"]
    # at maximum depth every beam is complete: 4 completions, each scored on every step
    assert len(result.completions) == 4 and all(len(s) == 3 for s in result.scores)
    assert result.tree_size == 12


@pytest.mark.parametrize("n, beam_width, kept, counts", [(6, 4, 1, [6]), (7, 2, 3, [3, 2, 2])])
def test_beam_search_keeps_n_over_m_rounded_down_where_m_does_not_divide_n(n, beam_width, kept, counts):
    """Search-and-Learn's beam search keeps n // beam_width beams and samples them round-robin up to n
    (its Config refuses an n that beam_width does not divide for DVTS only); this refused n=6 with the
    default width 4 (`treeserve search --n 6`, /v1/search's n=6: a 400)."""
    values = {"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.7}
    script = Script(lambda text, j: ("abcd"[j % 4] + "\n\n", "step"), lambda s: values[s])
    result = script.run(beam_config(n=n, beam_width=beam_width))
    first, second, third = script.samples
    assert first.counts == [n] and len(second.beams) == len(third.beams) == kept
    assert second.counts == third.counts == counts
    assert len(result.completions) == n


@pytest.mark.parametrize("strategy", ["beam", "dvts"])
@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_usage_counts_every_token_generated_lookahead_rollouts_too(strategy, lookahead):
    """`completion_tokens` (what the gateway bills) is every token the generator wrote; a lookahead's
    rollouts were left out (a helper measured usage 692 against 1266 generated at lookahead 1)."""
    script = Script(lambda text, j: ("abcd"[j % 4] + "\n\n", "step"), lambda s: 0.5)
    result = script.run(beam_config(strategy=strategy, lookahead=lookahead, num_iterations=4))
    generated = sum(sum(sample.counts) for sample in script.samples)  # (each scripted step is 1 token)
    assert result.completion_tokens == generated
    assert any(sample.greedy for sample in script.samples) == (lookahead > 0)


def test_max_depth_samples_to_the_end_only_when_asked():
    script = Script(lambda text, j: ("x\n\n", "step"), lambda s: 0.5)
    script.run(beam_config(num_iterations=2))
    assert [s.to_end for s in script.samples] == [False, False]
    script = Script(lambda text, j: ("x\n\n", "step"), lambda s: 0.5)
    script.run(beam_config(num_iterations=2, eos_sampling_at_max_depth=True))
    assert [s.to_end for s in script.samples] == [False, True]


def test_ties_go_to_the_earlier_beam():
    script = Script(lambda text, j: ("abcd"[j] + "\n\n", "step"), lambda s: 0.5)
    script.run(beam_config(num_iterations=2))
    assert [b.text for b in script.samples[1].beams] == ["a\n\n", "b\n\n"]


def test_filter_duplicates_drops_repeated_texts_before_ranking():
    steps = lambda text, j: ("aabb"[j] + "\n\n", "step")  # noqa: E731
    scores = {"a": 0.9, "b": 0.1}
    kept = Script(steps, lambda s: scores[s])
    kept.run(beam_config(num_iterations=2))
    assert [b.text for b in kept.samples[1].beams] == ["a\n\n", "a\n\n"]
    unique = Script(steps, lambda s: scores[s])
    unique.run(beam_config(num_iterations=2, filter_duplicates=True))
    assert [b.text for b in unique.samples[1].beams] == ["a\n\n", "b\n\n"]


def test_completed_beams_are_set_aside_and_padded_to_n():
    # the root's continuation 0 ends the solution; the others continue
    def steps(text, j):
        return ("done \\boxed{1}", "eos") if text == "" and j == 0 else ("go\n\n", "step")
    script = Script(steps, lambda s: 0.9 if "boxed" in s else 0.2)
    result = script.run(beam_config(num_iterations=3))
    assert result.completions[0] == "done \\boxed{1}"
    assert script.samples[1].counts == [2, 2]  # two unfinished survivors still share the N samples
    assert len(result.completions) == 4
    # only one solution finished early; the rest complete at max depth
    assert result.answers[0] == "1"


def test_sort_completed_orders_by_aggregated_score():
    def steps(text, j):
        return (f"end{j}", "eos")
    script = Script(steps, lambda s: {"end0": 0.1, "end1": 0.4, "end2": 0.3, "end3": 0.8}[s])
    first = script.run(beam_config(sort_completed=False))
    best = Script(steps, script.score).run(beam_config(sort_completed=True))
    assert first.completions == ["end0", "end1", "end2", "end3"]
    assert best.completions == ["end3", "end1", "end2", "end0"]
    assert best.chosen == 0 and first.chosen == 3


def test_dvts_extends_each_subtree_with_its_best_step_and_stops_at_a_boxed_answer():
    def steps(text, j):
        depth = text.count("\n\n")
        return ("\\boxed{7}\n\n" if depth == 1 and j == 1 else f"s{depth}{j}\n\n", "step")
    script = Script(steps, lambda s: 0.9 if "boxed" in s else (0.6 if s.endswith("1") else 0.3))
    result = script.run(SearchConfig(strategy="dvts", n=4, beam_width=2, num_iterations=5, seed=0))
    assert script.samples[0].counts == [2, 2]        # two subtrees, two samples each
    assert len(script.samples) == 2                  # both subtrees stop once the best step is boxed
    assert len(result.completions) == 4
    assert result.pred == "7"


def test_best_of_n_weighted_and_majority_choose_differently():
    answers = ["\\boxed{1}", "\\boxed{2}", "\\boxed{2}", "\\boxed{3}", "\\boxed{3}", "\\boxed{3}"]
    scores = {"\\boxed{1}": 0.95, "\\boxed{2}": 0.6, "\\boxed{3}": 0.3}

    def run(strategy):
        return Script(lambda text, j: (answers[j], "eos"), lambda s: scores[s]).run(
            SearchConfig(strategy=strategy, n=6, seed=0))

    assert run("best_of_n").pred == "1"           # the single best score
    assert run("majority").pred == "3"            # the most frequent answer
    assert run("weighted_best_of_n").pred == "2"  # 0.6 + 0.6 beats 0.95 and 3 x 0.3


@pytest.mark.parametrize("strategy", ["beam", "dvts"])
@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_the_last_progress_event_counts_the_tree_as_the_result_does(strategy, lookahead):
    """A streamed search's progress counted a lookahead's rollouts as tree nodes and live beams, so its
    last event said tree_size 20 where the result said 12 (beam, lookahead 1, N=4, 3 iterations)."""
    script = Script(lambda text, j: ("abcd"[j % 4] + "\n\n", "step"), lambda s: 0.5)
    result = script.run(beam_config(strategy=strategy, lookahead=lookahead))
    progress = SearchProgress()
    for sample, reply in zip(script.samples, script.replies):
        progress.on_sampled(sample, reply)
    assert (progress.tree_size, progress.completion_tokens) == (result.tree_size, result.completion_tokens)
    assert progress.live_beams == len([s for s in script.samples if not s.greedy][-1].beams)


def _sampling_seeds(samples: list[Sample]) -> list[list[int]]:
    """Each sampled (not greedy) action's seeds, one per continuation: continuation j of beam i is
    drawn with seeds[i] + j (the runner's contract, tree.Sample)."""
    return [[seed + j for seed, count in zip(s.seeds, s.counts) for j in range(count)]
            for s in samples if not s.greedy]


@pytest.mark.parametrize("config", [
    SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=3, seed=0),
    SearchConfig(strategy="beam", n=6, beam_width=2, num_iterations=3, seed=5),   # 3 survivors, 2 samples each
    SearchConfig(strategy="dvts", n=16, beam_width=4, num_iterations=3, seed=0),
    SearchConfig(strategy="dvts", n=8, beam_width=2, num_iterations=3, lookahead=1, seed=3),
], ids=["beam-16-4", "beam-6-2", "dvts-16-4", "dvts-8-2-lookahead"])
def test_every_continuation_of_a_sampling_round_has_a_seed_of_its_own(config):
    """Seeds one apart per beam gave continuation 1 of beam i the seed of continuation 0 of beam
    i+1: DVTS's subtrees, all sampled from the empty solution at depth 0, drew the same first steps
    (16 candidates from 7 seeds at N=16, M=4), and beam search's equal survivors the same steps."""
    script = Script(lambda text, j: (f"{text.count(chr(10))}{j}\n\n", "step"), lambda s: 0.5)
    script.run(config)
    rounds = _sampling_seeds(script.samples)
    assert len(rounds) == config.num_iterations
    for seeds in rounds:
        assert len(seeds) == config.n and len(set(seeds)) == config.n, seeds


@pytest.mark.parametrize("config", [
    SearchConfig(strategy="beam", n=16, beam_width=4, num_iterations=4, seed=0),
    SearchConfig(strategy="beam", n=6, beam_width=2, num_iterations=4, lookahead=1, seed=5),
    SearchConfig(strategy="dvts", n=16, beam_width=4, num_iterations=4, seed=0),
    SearchConfig(strategy="dvts", n=8, beam_width=2, num_iterations=4, lookahead=1, seed=3),
], ids=["beam-16-4", "beam-6-2-lookahead", "dvts-16-4", "dvts-8-2-lookahead"])
def test_the_sampling_rounds_of_one_problem_draw_with_seeds_of_their_own(config):
    """Round d+1's seeds were round d's shifted by one (`seed_for(seed, index, depth)` grows by one a
    depth): 15 of a beam search's 16 continuations at depth 1 drew the random numbers of a depth-0
    continuation, and each DVTS subtree re-drew, one continuation over, the numbers of its last round."""
    script = Script(lambda text, j: (f"{text.count(chr(10))}{j}\n\n", "step"), lambda s: 0.5)
    script.run(config)
    seeds = [seed for round_seeds in _sampling_seeds(script.samples) for seed in round_seeds]
    assert len(seeds) == config.n * config.num_iterations and len(set(seeds)) == len(seeds), seeds


def test_the_problems_of_one_run_sample_with_seeds_of_their_own():
    """Best-of-N's seed for problem i was problem i-1's plus one: neighbouring problems of an eval drew
    N - 1 of their samples with the same numbers."""
    config = SearchConfig(strategy="best_of_n", n=8, seed=0)
    seeds = []
    for index in range(4):
        script = Script(lambda text, j: ("\\boxed{1}", "eos"), lambda s: 0.5)
        script.run(config, problem_index=index)
        seeds += _sampling_seeds(script.samples)[0]
    assert len(set(seeds)) == len(seeds), seeds


@pytest.mark.parametrize("other", [2 ** 31, 2 ** 31 + 7, 3 * 2 ** 31])
def test_distinct_seeds_below_2_to_the_32_search_with_distinct_samples(other):
    """The seed tree was kept to 31 bits after its first part: `seed` and `seed + 2**31` asked for the
    same seeds, so a search with seed 2**31 repeated seed 0's (seed 2**31 + 7 seed 7's, and so on).
    Seeds equal modulo 2**32 still search alike: the engine's draws read a seed's low 32 bits."""
    def seeds(seed: int) -> list[int]:
        script = Script(lambda text, j: (f"{text.count(chr(10))}{j}\n\n", "step"), lambda s: 0.5)
        script.run(beam_config(n=8, beam_width=2, num_iterations=3, seed=seed))
        return [x % 2 ** 32 for round_seeds in _sampling_seeds(script.samples) for x in round_seeds]
    assert set(seeds(other % 2 ** 31)).isdisjoint(seeds(other))
    assert seeds(other) == seeds(other + 2 ** 32)


@pytest.mark.parametrize("change, said", [({"seed": 1.5}, "seed: must be an integer"),
                                          ({"seed": 2 ** 64}, "seed: must be an integer in [-2**63, 2**64)"),
                                          ({"filter_duplicates": "no"}, "filter_duplicates: must be true or false"),
                                          ({"sort_completed": 1}, "sort_completed: must be true or false"),
                                          ({"eos_sampling_at_max_depth": None},
                                           "eos_sampling_at_max_depth: must be true or false"),
                                          ({"temperature": "0.8"}, "temperature: must be a number >= 0 and finite"),
                                          ({"temperature": float("inf")}, "temperature: must be a number >= 0 and"),
                                          ({"top_p": None}, "top_p: must be in (0, 1], got None"),
                                          ({"n": True}, "n: must be an integer >= 1, got True"),
                                          ({"system_prompt": 5}, "system_prompt: must be a string or None")])
def test_a_config_names_a_value_of_the_wrong_kind(change, said):
    """(a seed of 1.5 failed the search with a TypeError from the seed tree; "no" turned
    filter_duplicates on, a non-empty string being true; a temperature of "0.8" was a TypeError from a
    comparison, an infinite one failed each problem in SamplingParams, n=True was a search of one, and
    a system prompt of 5 failed in the chat template)"""
    with pytest.raises(ValueError) as refused:
        SearchConfig(**change)
    assert said in str(refused.value)


def test_weighted_best_of_n_answers_with_the_best_scored_completion_of_the_winning_answer():
    """The reply's `completion` and `score` were the first completion with the winning answer, however
    low the verifier scored it (0.1 here, where the same answer's best completion scored 0.7)."""
    texts = ["a \\boxed{2}", "b \\boxed{1}", "c \\boxed{2}", "d \\boxed{2}"]
    scores = {texts[0]: 0.1, texts[1]: 0.75, texts[2]: 0.7, texts[3]: 0.4}
    result = Script(lambda text, j: (texts[j], "eos"), lambda s: scores[s]).run(
        SearchConfig(strategy="weighted_best_of_n", n=4, seed=0))
    assert result.pred == "2" and result.chosen == 2 and result.agg_scores[result.chosen] == 0.7


def test_greedy_samples_once_without_the_verifier():
    script = Script(lambda text, j: ("\\boxed{5}", "eos"), lambda s: pytest.fail("greedy must not score"))
    result = script.run(SearchConfig(strategy="greedy"))
    assert script.samples[0].greedy and result.pred == "5"


@pytest.mark.parametrize("how, expected", [("last", 0.5), ("min", 0.2), ("prod", 0.9 * 0.2 * 0.5)])
def test_aggregation(how, expected):
    assert aggregate([0.9, 0.2, 0.5], how) == pytest.approx(expected)


def test_bad_config_names_the_parameter():
    with pytest.raises(ValueError, match="beam_width"):
        SearchConfig(strategy="dvts", n=6, beam_width=4)
    with pytest.raises(ValueError) as refused:
        SearchConfig(strategy="beam", n=4, beam_width=8)
    assert "n (4) must be at least beam_width (8)" in str(refused.value)
    # (`treeserve search --n 6` and /v1/search's n=6 named a beam_width the user never gave)
    with pytest.raises(ValueError) as refused:
        SearchConfig(strategy="dvts", n=6)
    assert "n (6) must be a multiple of beam_width (4, the default where none is given)" in str(refused.value)
    with pytest.raises(ValueError, match="agg_strategy"):
        SearchConfig(agg_strategy="mean")
