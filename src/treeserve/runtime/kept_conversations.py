"""The verifier conversations whose KV the engine keeps for later forks, in release order.

A search extends a scored conversation by one step, and it extends the steps that scored best:
of the candidates sharing a parent (the same question and earlier steps), the ones scoring below
the best are the likeliest never to be read again. They move to the front of the release order,
so that pressure on the KV pool frees them (and, once released, their private blocks are the
oldest in the eviction queue) before the candidate a search will most likely extend.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

StepKey = tuple  # (question, step 1, ..., step k): the key of step k's score


class KeptConversations:
    def __init__(self):
        self._ids: OrderedDict[StepKey, str] = OrderedDict()  # released first at the front
        self._children: dict[StepKey, set[StepKey]] = {}  # parent -> kept keys extending it by one step

    def __contains__(self, key: StepKey) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[StepKey]:
        return iter(list(self._ids))

    def get(self, key: StepKey) -> str | None:
        return self._ids.get(key)

    def add(self, key: StepKey, request_id: str) -> None:
        """Keeps a conversation at the back of the release order (`key` must not be kept yet)."""
        self._ids[key] = request_id
        self._children.setdefault(key[:-1], set()).add(key)

    def pop(self, key: StepKey) -> str:
        request_id = self._ids.pop(key)
        children = self._children[key[:-1]]
        children.discard(key)
        if not children:
            del self._children[key[:-1]]
        return request_id

    def first(self) -> StepKey:
        """The conversation released next."""
        return next(iter(self._ids))

    def demote_below_best(self, key: StepKey, score_of: Callable[[StepKey], float | None]) -> list[str]:
        """Moves the kept siblings of `key` (itself included) that score below their best to the
        front of the release order; returns their request ids. Siblings without a known score stay."""
        scored = [(score, k) for k in self._children.get(key[:-1], ()) if (score := score_of(k)) is not None]
        if len(scored) < 2:
            return []
        best = max(scored)[1]  # ties go to the larger key: the same choice in every run
        demoted = []
        for _, sibling in sorted(scored, key=lambda item: item[1]):
            if sibling != best:
                self._ids.move_to_end(sibling, last=False)
                demoted.append(self._ids[sibling])
        return demoted
