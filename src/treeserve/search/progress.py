"""What a running search reports as it goes: the progress events of a streamed `/v1/search`."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from treeserve.search.tree import Sample, aggregate


@dataclass
class SearchProgress:
    iteration: int = 0             # scoring rounds done (a beam-search depth, or best-of-N's one round)
    live_beams: int = 0            # beams the last sampling round extended
    best_score: float | None = None  # best aggregated score of any candidate scored so far
    completion_tokens: int = 0     # tokens generated so far
    verifier_tokens: int = 0       # tokens submitted to the verifier so far (computed or reused)
    tree_size: int = 0             # steps generated so far

    def on_sampled(self, action: Sample, sampled: list[list]) -> None:
        """A lookahead's rollouts count as tokens generated, not as beams or tree nodes (the result's
        `tree_size` has none of them; the last progress event had them all)."""
        self.completion_tokens += sum(len(step.token_ids) for steps in sampled for step in steps)
        if not action.rollout:
            self.live_beams = len(action.beams)
            self.tree_size += sum(len(steps) for steps in sampled)

    def on_scored(self, scores: list[list[float]], how: str) -> None:
        self.iteration += 1
        best = max((aggregate(s, how) for s in scores if s), default=None)
        if best is not None and (self.best_score is None or best > self.best_score):
            self.best_score = best

    def as_event(self) -> dict:
        return {"object": "search.progress", **asdict(self)}
