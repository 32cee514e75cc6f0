"""A seeded request's random numbers, by output position (the sampler's and the verification's)."""
from __future__ import annotations

import torch

DRAW_CHUNK = 64  # numbers drawn from a seed's generator at a time


class SeededDraws:
    """A seeded request's uniform numbers by output position: the k-th is the k-th number its
    seed's generator gives (drawn in order and kept), so position k draws the same number however
    many times, and in whatever order, it is sampled (a verified draft's row, a preempted request's
    rerun)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.values: list[float] = []

    @classmethod
    def of(cls, seed: int | None) -> "SeededDraws | None":
        return None if seed is None else cls(seed)

    def at(self, index: int) -> float:
        while len(self.values) <= index:  # (one call a chunk: a CPU generator's n numbers drawn at once are
            # its next n drawn one by one, tests/test_sampling.py checks; one call a number took ~1.7 us)
            self.values.extend(torch.rand(DRAW_CHUNK, dtype=torch.float64, generator=self.generator).tolist())
        return self.values[index]
