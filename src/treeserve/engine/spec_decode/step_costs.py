"""What a draft token costs, measured: a running least-squares fit of each step's seconds against
its rows (seconds ~ fixed + per_row x rows), exponentially weighted so that it follows the load.

A draft token is one more row; a kept one saves the share of a step that one token costs. With B
requests running, a token costs fixed / B + per_row, so drafting a token pays when its chance of
being kept is above per_row / (fixed / B + per_row) (`keep_threshold`). Few rows on a CPU read
every weight once whatever their number (fixed >> per_row: draft freely); a full batch is
compute (per_row dominates: draft only what is nearly sure)."""
from __future__ import annotations

DECAY = 0.97           # weight of the fit's past per step (about the last 30 steps count)
MIN_STEPS = 8          # steps seen before the fit is trusted
DEFAULT_THRESHOLD = 0.1
MIN_THRESHOLD, MAX_THRESHOLD = 0.02, 0.95
PASS_WEIGHT = 0.1      # of a new pass in a draft model's cost per token


class StepCosts:
    def __init__(self):
        self.num_steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        self.num_steps += 1
        d = DECAY
        self._w = d * self._w + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row); None until the steps seen vary enough in rows."""
        if self.num_steps < MIN_STEPS:
            return None
        spread = self._w * self._xx - self._x * self._x
        if spread <= 1e-9 * max(self._w * self._xx, 1.0):
            return None
        per_row = (self._w * self._xy - self._x * self._y) / spread
        fixed = (self._y - per_row * self._x) / self._w
        if per_row <= 0 or fixed <= 0:
            return None
        return fixed, per_row

    def token_seconds(self, batch: int) -> float | None:
        """What one token of a step costs with `batch` requests running (None until fitted)."""
        fitted = self.fit()
        return None if fitted is None else fitted[0] / max(batch, 1) + fitted[1]

    def keep_threshold(self, batch: int) -> float:
        """The chance of being kept above which a draft token pays, with `batch` requests running."""
        fitted = self.fit()
        if fitted is None:
            return DEFAULT_THRESHOLD
        fixed, per_row = fitted
        threshold = per_row / (fixed / max(batch, 1) + per_row)
        return min(max(threshold, MIN_THRESHOLD), MAX_THRESHOLD)


class PassCosts:
    """What a proposer's own work costs per draft token (a running mean: a draft model's passes,
    the lookups' host time): a draft token pays only when its chance of being kept covers its
    verification row and its share of the passes, so that share of a step's token cost is added
    to the keep threshold (no cap: at 1 or more nothing is drafted, as not even a sure token pays)."""

    def __init__(self):
        self.seconds_per_token: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens:
            sample = seconds / tokens
            last = self.seconds_per_token
            self.seconds_per_token = sample if last is None else last + PASS_WEIGHT * (sample - last)

    def share_of(self, token_seconds: float | None) -> float:
        """The draft token's cost as a share of what a step's token costs (0 until both are known)."""
        if self.seconds_per_token is None or not token_seconds:
            return 0.0
        return self.seconds_per_token / token_seconds
