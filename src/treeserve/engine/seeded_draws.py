"""A seeded request's random numbers, by output position (the sampler's and the verification's)."""
from __future__ import annotations

import torch


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
        while len(self.values) <= index:
            self.values.append(float(torch.rand((), dtype=torch.float64, generator=self.generator)))
        return self.values[index]
