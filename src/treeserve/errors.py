"""Errors every layer may raise; this module imports nothing from treeserve."""
from __future__ import annotations


class ParamError(ValueError):
    """A bad value for one named parameter. The message reads "param: detail", and `param` carries the
    name so that callers (the server's error body) need not parse it out of the text."""

    def __init__(self, param: str, detail: str):
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail
