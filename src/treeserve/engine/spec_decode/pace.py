"""How many tokens a request drafts next, from how its own drafts fared and what a draft costs.

Each request keeps a running estimate of the chance that its next draft token is kept (`rate`,
from its verified drafts: kept tokens are successes, the first rejected one a failure). Position
i of a draft is kept with chance about rate^i, so a draft runs as long as that stays above the
step's keep threshold (step_costs.py). A request whose rate is under the threshold drafts nothing,
except a one-token probe after 1, 2, 4, ... steps (up to MAX_PAUSE) so that its rate can recover.
A new request starts from the engine's recent rate, and where that is under the threshold, paused
(a search's short requests would otherwise each pay for a probe that the load shows is not worth it)."""
from __future__ import annotations

import math
from dataclasses import dataclass

INITIAL_RATE = 0.5
WEIGHT = 0.3  # of a new verification in the rate
MAX_PAUSE = 16


@dataclass
class DraftPace:
    rate: float = INITIAL_RATE
    pause: int = 0   # steps left before the next probe
    misses: int = 0  # probes in a row that kept nothing

    @classmethod
    def starting(cls, rate: float, threshold: float) -> "DraftPace":
        return cls(rate, pause=0 if rate >= threshold else MAX_PAUSE)

    def allowed(self, threshold: float, k: int) -> int:
        """Tokens the request may draft for its next step, given the keep threshold."""
        if self.rate >= threshold:
            if self.rate >= 1.0 or threshold <= 0:
                return k
            return max(1, min(k, int(math.log(threshold) / math.log(self.rate))))
        if self.pause:
            self.pause -= 1
            return 0
        self.pause = min(2 ** self.misses, MAX_PAUSE)
        return 1

    def update(self, drafted: int, accepted: int) -> None:
        self.rate += WEIGHT * (kept_rate(drafted, accepted) - self.rate)
        self.misses = self.misses + 1 if accepted == 0 else 0


def kept_rate(drafted: int, accepted: int) -> float:
    """A verified draft's evidence on the chance of keeping a token: the kept tokens are
    successes, the first rejected one (if any) a failure."""
    failures = 1 if accepted < drafted else 0
    return accepted / (accepted + failures) if accepted + failures else 1.0
