"""What search strategies ask of the models, and what they build: actions, steps, beams, results.

A strategy is a generator per problem: it yields `Sample` or `Score` actions and receives their
results, so one strategy runs unchanged on any backend (the engine's continuous batching, the
Search-and-Learn reference, or a scripted fake in tests).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeserve.errors import ParamError
from treeserve.search.config import STEP_DELIMITER, reads_verifier

# A verifier's scores are probabilities that a step (or a solution) is right: a best candidate under
# one half is one it judged more likely wrong than right.
REJECT_THRESHOLD = 0.5


@dataclass
class Step:
    """One generated continuation: its text, its token ids and why it ended."""
    text: str
    token_ids: list[int]
    finish: str  # "step" (ended at the delimiter), "eos", or "length"


@dataclass
class Beam:
    """A partial solution: generated text and token ids after the prompt."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)

    def extend(self, step: Step) -> "Beam":
        return Beam(self.text + step.text, self.token_ids + step.token_ids)

    @property
    def steps(self) -> list[str]:
        return split_steps(self.text)


@dataclass
class Sample:
    """Generate `counts[i]` continuations of `beams[i]`: one step (to the delimiter), or to the end.

    Continuation j of beam i is sampled with seed `seeds[i] + j`. A `rollout` (lookahead) is scored
    but never kept: its steps are no nodes of the search tree (its tokens are still generated)."""
    beams: list[Beam]
    counts: list[int]
    seeds: list[int]
    to_end: bool = False
    greedy: bool = False
    rollout: bool = False


@dataclass
class Score:
    """Score every step of each solution text with the verifier."""
    question: str
    texts: list[str]

    def items(self) -> list[tuple[str, list[str]]]:
        """(question, steps) for each text that has steps: what the verifier is asked."""
        return [(self.question, steps) for steps in map(split_steps, self.texts) if steps]

    def reply(self, scores: list[list[float]]) -> list[list[float]]:
        """Scores of `items()` spread back over the texts; a text without steps gets none."""
        flat = iter(scores)
        return [next(flat) if split_steps(t) else [] for t in self.texts]


@dataclass
class SearchResult:
    problem: str
    strategy: str
    completions: list[str]
    scores: list[list[float]]       # per completion, one score per step
    agg_scores: list[float]
    chosen: int                     # index of the chosen completion
    tree_size: int                  # steps generated (nodes of the search tree)
    completion_tokens: int          # tokens the generator produced
    answers: list[str | None] = field(default_factory=list)
    pred: str | None = None
    seconds: float = 0.0
    agg_strategy: str | None = None  # how `agg_scores` were folded (None: the strategy reads no verifier)
    prompt_tokens: int = 0          # the question's tokens as the generator reads them (its prompt, counted once)
    verifier_tokens: int = 0        # tokens submitted to the verifier (computed or reused from its cache)

    @property
    def usage(self) -> dict:
        """OpenAI's usage fields for the search: the prompt counted once (as for `n` choices), every
        token the generator wrote, and what the verifier was given to read."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "verifier_tokens": self.verifier_tokens}

    @property
    def verifier_rejected_all(self) -> bool:
        """The verifier scored candidates and judged even the best one more likely wrong than right
        (its aggregated score under REJECT_THRESHOLD): the answer is a guess. False where nothing was
        scored (greedy, majority)."""
        scored = [agg for agg, steps in zip(self.agg_scores, self.scores) if steps]
        return bool(scored) and max(scored) < REJECT_THRESHOLD

    @property
    def reported_agg_scores(self) -> list[float | None]:
        """`agg_scores` as replies and records show them: None where the strategy reads no verifier
        (greedy, majority), since a 0 would say the verifier judged the answer wrong."""
        return self.agg_scores if reads_verifier(self.strategy) else [None] * len(self.completions)


def split_steps(text: str, delimiter: str = STEP_DELIMITER) -> list[str]:
    """The steps of a solution as the verifier sees them: `delimiter` (a blank line) separated,
    non-empty, stripped."""
    return [s.strip() for s in text.split(delimiter) if s.strip()]


def aggregate(scores: list[float], how: str) -> float:
    """One number for a solution's step scores; a solution with no steps scores 0."""
    if not scores:
        return 0.0
    if how == "last":
        return scores[-1]
    if how == "min":
        return min(scores)
    if how == "prod":
        return math.prod(scores)
    raise ParamError("agg_strategy", f"unknown aggregation {how!r}")


def seed_for(base: int, *path: int) -> int:
    """A sampling seed fixed by the config seed and the position in the tree, not by batching:
    `base * P**k + (path[0] + 1) * P**(k-1) + ... + path[-1] + 1` modulo 2**31 (P = 1,000,003), with the
    base's bit 31 kept as the seed's. Within a problem every place differs. The engine's seeded draws
    read a seed's low 32 bits (torch's CPU generator), so seeds equal modulo 2**32 search alike; the
    tree kept 31 of them, so `seed` and `seed + 2**31` did too (the bit is now kept, and every seed
    under 2**31 asks for the seeds it asked for before)."""
    value = base & 0x7FFFFFFF
    for part in path:
        value = (value * 1_000_003 + part + 1) & 0x7FFFFFFF
    return value | (base & 0x80000000)


def step_from_completion(completion) -> Step:
    """A generator output as a step: ended at the delimiter, at end-of-sequence, or at a length limit."""
    if completion.finish_reason == "length":
        finish = "length"
    elif completion.stop_reason == STEP_DELIMITER:
        finish = "step"
    else:
        finish = "eos"
    return Step(completion.text, list(completion.token_ids), finish)
