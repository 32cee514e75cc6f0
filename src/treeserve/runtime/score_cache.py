"""Placeholder until the bounded cache lands (replaced in the merge)."""
from collections import OrderedDict


class ScoreCache(OrderedDict):
    def __init__(self, max_bytes: int = 64 << 20):
        super().__init__()
        self.max_bytes = max_bytes
