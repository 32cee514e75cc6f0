"""A quantized checkpoint's tensors gathered while the loader reads it, decoded module by module."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from treeserve.errors import ParamError
from treeserve.model.quantization.formats import CheckpointFormat
from treeserve.model.quantization.weights import FloatWeight, IntWeight


class QuantizedTensors:
    """Gathers each quantized module's tensors as the loader reads them; a module is decoded as soon as
    its last tensor arrives (`add` says when), so that a load holds one module's packed tensors at a
    time beside the decoded ones, not the whole checkpoint's."""

    def __init__(self, fmt: CheckpointFormat, names: Iterable[str]):
        names = list(names)
        self.format = fmt
        self.modules = fmt.quantized_modules(names)  # checkpoint prefixes, e.g. model.layers.0.self_attn.q_proj
        self._expected: dict[str, set[str]] = {}  # each module's tensors in the checkpoint
        for name in names:
            prefix, _, suffix = name.rpartition(".")
            if prefix in self.modules and fmt.owns(prefix, suffix):
                self._expected.setdefault(prefix, set()).add(suffix)
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}

    def owns(self, name: str) -> bool:
        """Whether `name` is part of a quantized module's weight (its bias loads as any other)."""
        prefix, _, suffix = name.rpartition(".")
        return prefix in self.modules and self.format.owns(prefix, suffix)

    def add(self, name: str, tensor: torch.Tensor) -> str | None:
        """Keeps `tensor`; returns its module's prefix once every tensor of the module is here."""
        prefix, _, suffix = name.rpartition(".")
        tensors = self._tensors.setdefault(prefix, {})
        tensors[suffix] = tensor
        return prefix if tensors.keys() >= self._expected.get(prefix, set()) else None

    def decode(self, prefix: str) -> IntWeight | FloatWeight:
        """The module's weight, its tensors dropped."""
        tensors = self._tensors.pop(prefix)
        try:
            return self.format.decode(prefix, tensors)
        except ParamError:
            raise
        except KeyError as exc:
            raise ValueError(f"{self.format.method}: {prefix} lacks its {exc.args[0]!r} tensor") from exc
        except (RuntimeError, IndexError, ValueError) as exc:
            raise ParamError("quantization", f"{self.format.method}: {prefix}'s tensors "
                             f"({', '.join(f'{k} {tuple(v.shape)}' for k, v in tensors.items())}) do not "
                             f"fit its quantization_config ({exc})") from exc

    def decoded(self) -> Iterator[tuple[str, IntWeight | FloatWeight]]:
        """Each module not yet decoded (its prefix and weight), its tensors dropped once decoded."""
        for prefix in sorted(self._tensors):
            yield prefix, self.decode(prefix)
