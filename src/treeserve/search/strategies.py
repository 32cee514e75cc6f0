"""The search strategies, as Search-and-Learn defines them, written as per-problem generators.

Each yields `Sample` and `Score` actions (see `tree.py`) and returns a `SearchResult`. Where S&L
has a defect, the behaviour here is deliberate and documented in docs/SEARCH.md:
ties are broken by position (first wins) instead of by an unstable sort; every beam is complete at
maximum depth, with or without end-of-sequence sampling there; lookahead text is scored in beam
search too (S&L generates it and then ignores it); a DVTS subtree whose chosen step hit the token
limit stops (S&L would keep extending it); a problem with no completed beam cannot crash.
"""
from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field

from treeserve.search.config import SearchConfig, with_aggregation
from treeserve.search.grading import canonical_form, extract_answer, majority_vote, weighted_vote
from treeserve.search.tree import Beam, Sample, Score, SearchResult, Step, aggregate, seed_for

Action = Sample | Score
Strategy = Generator[Action, list, SearchResult]


def run_strategy(question: str, config: SearchConfig, problem_index: int = 0) -> Strategy:
    """The generator that solves one problem with `config.strategy` (an aggregation left unnamed is
    `last`: the runners name the verifier's declared one first, `config.with_aggregation`)."""
    config = with_aggregation(config, None)
    if config.strategy == "greedy":
        return _greedy(question, config, problem_index)
    if config.strategy in ("majority", "best_of_n", "weighted_best_of_n"):
        return _sample_and_score(question, config, problem_index)
    if config.strategy == "beam":
        return _beam_search(question, config, problem_index)
    return _dvts(question, config, problem_index)


def _greedy(question: str, config: SearchConfig, index: int) -> Strategy:
    sampled = yield Sample([Beam()], [1], [seed_for(config.seed, index)], to_end=True, greedy=True)
    step = sampled[0][0]
    return _result(question, config, [step.text], [[]], tree_size=1, tokens=len(step.token_ids))


def _sample_and_score(question: str, config: SearchConfig, index: int) -> Strategy:
    """N independent completions; majority vote needs no verifier, the best-of-N variants score them."""
    # (depth 0 of the seed tree: `seed_for(seed, index)` alone is the next problem's minus one, so
    # neighbouring problems drew n - 1 of their samples from the same seeds)
    sampled = yield Sample([Beam()], [config.n], [seed_for(config.seed, index, 0)], to_end=True)
    texts = [step.text for step in sampled[0]]
    scores = (yield Score(question, texts)) if config.uses_verifier else [[] for _ in texts]
    tokens = sum(len(step.token_ids) for step in sampled[0])
    return _result(question, config, texts, scores, tree_size=len(texts), tokens=tokens)


# ---- beam search ---------------------------------------------------------------------------
def _beam_search(question: str, config: SearchConfig, index: int) -> Strategy:
    """N beams; each step the survivors are sampled round-robin up to N candidates, every candidate
    is scored, finished ones are set aside, and the best N // beam_width unfinished ones survive (any N, as S&L)."""
    keep = config.n // config.beam_width
    active = [Beam()]
    completed: list[tuple[Beam, list[float]]] = []
    tree_size = tokens = 0
    for depth in range(config.num_iterations):
        at_max_depth = depth == config.num_iterations - 1
        counts = _round_robin_counts(len(active), config.n)
        seeds = _spaced_seeds(_round_seed(config, index, depth), counts)
        sampled = yield Sample(active, counts, seeds, to_end=at_max_depth and config.eos_sampling_at_max_depth)
        # S&L's candidate order: survivors repeated round-robin, (b1, b2, ..., b1, b2, ...)
        order = [(j % len(active), j // len(active)) for j in range(config.n)]
        steps = [sampled[b][k] for b, k in order]
        candidates = [active[b].extend(step) for (b, _), step in zip(order, steps)]
        tree_size += len(candidates)
        tokens += sum(len(s.token_ids) for s in steps)
        rollouts, rolled = yield from _lookahead(candidates, steps, config, index, depth, at_max_depth)
        tokens += rolled
        scores = yield Score(question, [c.text + r for c, r in zip(candidates, rollouts)])
        done = [at_max_depth or _ends_solution(step) for step in steps]
        completed += [(c, s) for c, s, d in zip(candidates, scores, done) if d]
        remaining = [(c, aggregate(s, config.agg_strategy)) for c, s, d in zip(candidates, scores, done) if not d]
        if not remaining:
            break
        if config.filter_duplicates:
            remaining = _first_of_each_text(remaining)
        active = _best_in_order(remaining, keep)
    finals = _final_beams(completed, config)
    return _result(question, config, [b.text for b, _ in finals], [s for _, s in finals], tree_size, tokens)


def _round_seed(config: SearchConfig, index: int, depth: int) -> int:
    """The first of the `n` seeds a round of sampling at `depth` draws from: each round's follow the last
    round's. (`seed_for(seed, index, depth)` is one more at each depth, so round d+1's n seeds were round
    d's shifted by one: a step drew the random numbers of a step of the round before, beam i+1's
    continuation k those of beam i's continuation k+1, and DVTS's subtree the numbers it drew its last step with.)"""
    return seed_for(config.seed, index, depth * config.n)


def _spaced_seeds(first: int, counts: list[int]) -> list[int]:
    """Seeds for a Sample of `counts[i]` continuations of beam i, continuation j drawn with seed
    `seeds[i] + j`: one seed each. (Seeds one apart gave beam i's second continuation beam i+1's first
    seed: equal beams sampled equal steps, and 16 candidates of 4 beams drew from 7 seeds.)"""
    return [first + offset for offset in itertools.accumulate([0] + counts[:-1])]


def _round_robin_counts(num_beams: int, total: int) -> list[int]:
    return [total // num_beams + (1 if i < total % num_beams else 0) for i in range(num_beams)]


def _ends_solution(step: Step) -> bool:
    return step.finish in ("eos", "length") or step.text == ""


def _first_of_each_text(scored: list[tuple[Beam, float]]) -> list[tuple[Beam, float]]:
    seen: dict[str, tuple[Beam, float]] = {}
    for beam, score in scored:
        seen.setdefault(beam.text, (beam, score))
    return list(seen.values())


def _best_in_order(scored: list[tuple[Beam, float]], keep: int) -> list[Beam]:
    """The `keep` best beams (ties: the earlier one), in their original order."""
    ranked = sorted(range(len(scored)), key=lambda i: -scored[i][1])[:keep]
    return [scored[i][0] for i in sorted(ranked)]


def _final_beams(completed: list[tuple[Beam, list[float]]], config: SearchConfig) -> list[tuple[Beam, list[float]]]:
    if config.sort_completed:
        completed = sorted(completed, key=lambda c: -aggregate(c[1], config.agg_strategy))
    finals = completed[: config.n]
    if not finals:
        return [(Beam(), [])] * config.n
    return [finals[i % len(finals)] for i in range(config.n)]  # too few: repeat them, as S&L does


# ---- DVTS ----------------------------------------------------------------------------------
@dataclass
class _Subtree:
    beam: Beam = field(default_factory=Beam)
    candidates: list[Beam] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    stopped: bool = False


def _dvts(question: str, config: SearchConfig, index: int) -> Strategy:
    """N / beam_width independent subtrees, each greedily extended by its best of beam_width
    sampled steps; the result is every subtree's last beam_width candidates."""
    trees = [_Subtree() for _ in range(config.n // config.beam_width)]
    tree_size = tokens = 0
    for depth in range(config.num_iterations):
        live = [(i, t) for i, t in enumerate(trees) if not t.stopped]
        if not live:
            break
        at_max_depth = depth == config.num_iterations - 1
        first = _round_seed(config, index, depth)  # subtree i's continuations: its own beam_width seeds
        seeds = [first + i * config.beam_width for i, _ in live]
        sampled = yield Sample([t.beam for _, t in live], [config.beam_width] * len(live), seeds,
                               to_end=at_max_depth and config.eos_sampling_at_max_depth)
        steps = [step for per_tree in sampled for step in per_tree]
        candidates = [t.beam.extend(step) for (_, t), per_tree in zip(live, sampled) for step in per_tree]
        tree_size += len(candidates)
        tokens += sum(len(s.token_ids) for s in steps)
        rollouts, rolled = yield from _lookahead(candidates, steps, config, index, depth, at_max_depth)
        tokens += rolled
        scores = yield Score(question, [c.text + r for c, r in zip(candidates, rollouts)])
        width = config.beam_width
        for k, (_, tree) in enumerate(live):
            span = slice(k * width, (k + 1) * width)
            _advance(tree, candidates[span], steps[span], scores[span], config, at_max_depth)
    finals = [(c, s) for t in trees for c, s in zip(t.candidates, t.scores)]
    finals = finals or [(Beam(), [])] * config.n
    return _result(question, config, [b.text for b, _ in finals], [s for _, s in finals], tree_size, tokens)


def _advance(tree: _Subtree, candidates: list[Beam], steps: list[Step], scores: list[list[float]],
             config: SearchConfig, at_max_depth: bool) -> None:
    aggregated = [aggregate(s, config.agg_strategy) for s in scores]
    best = max(range(len(candidates)), key=lambda i: (aggregated[i], -i))
    tree.beam, tree.candidates, tree.scores = candidates[best], candidates, scores
    tree.stopped = at_max_depth or _ends_solution(steps[best]) or "boxed{" in tree.beam.text


# ---- shared pieces -------------------------------------------------------------------------
def _lookahead(candidates: list[Beam], steps: list[Step], config: SearchConfig, index: int, depth: int,
               at_max_depth: bool):
    """Greedy rollouts of `lookahead` further steps past each unfinished candidate: their texts, and
    the tokens generated for them (usage counts them: they are generated as any step is)."""
    rollouts, tokens = [""] * len(candidates), 0
    if config.lookahead == 0 or at_max_depth:
        return rollouts, tokens
    heads = {i: c for i, (c, s) in enumerate(zip(candidates, steps)) if not _ends_solution(s)}
    for ahead in range(config.lookahead):
        if not heads:
            break
        keys = list(heads)
        seeds = [seed_for(config.seed, index, depth, 10_000 + ahead, i) for i in keys]
        sampled = yield Sample([heads[i] for i in keys], [1] * len(keys), seeds, greedy=True, rollout=True)
        for i, per_beam in zip(keys, sampled):
            step = per_beam[0]
            rollouts[i] += step.text
            tokens += len(step.token_ids)
            heads[i] = heads[i].extend(step)
            if _ends_solution(step):
                del heads[i]
    return rollouts, tokens


def _result(question: str, config: SearchConfig, texts: list[str], scores: list[list[float]],
            tree_size: int, tokens: int) -> SearchResult:
    agg = [aggregate(s, config.agg_strategy) for s in scores]
    answers = [extract_answer(t) for t in texts]
    chosen = choose(config.strategy, answers, agg)
    return SearchResult(question, config.strategy, texts, scores, agg, chosen, tree_size, tokens,
                        answers=answers, pred=answers[chosen] if answers else None,
                        agg_strategy=config.agg_strategy if config.uses_verifier else None)


def choose(strategy: str, answers: list[str | None], agg_scores: list[float]) -> int:
    """Index of the completion a strategy answers with."""
    if not answers:
        return 0
    if strategy in ("majority", "weighted_best_of_n"):
        winner = majority_vote(answers) if strategy == "majority" else weighted_vote(answers, agg_scores)
        if winner is not None:  # its best-scored completion (majority: its first; they score alike)
            key = canonical_form(winner)
            voters = [i for i, a in enumerate(answers) if a is not None and canonical_form(a) == key]
            return voters[0] if strategy == "majority" else max(voters, key=lambda i: (agg_scores[i], -i))
    if strategy == "greedy":
        return 0
    return max(range(len(answers)), key=lambda i: (agg_scores[i], -i))
