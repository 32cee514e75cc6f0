"""A quantized checkpoint's tensors gathered while the loader reads it, decoded module by module."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from treeserve.errors import ParamError
from treeserve.model.quantization.formats import CheckpointFormat
from treeserve.model.quantization.weights import FloatWeight, IntWeight


class QuantizedTensors:
    def __init__(self, fmt: CheckpointFormat, names: Iterable[str]):
        self.format = fmt
        self.modules = fmt.quantized_modules(names)  # checkpoint prefixes, e.g. model.layers.0.self_attn.q_proj
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}

    def owns(self, name: str) -> bool:
        """Whether `name` is part of a quantized module's weight (its bias loads as any other)."""
        prefix, _, suffix = name.rpartition(".")
        return prefix in self.modules and self.format.owns(prefix, suffix)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        prefix, _, suffix = name.rpartition(".")
        self._tensors.setdefault(prefix, {})[suffix] = tensor

    def decoded(self) -> Iterator[tuple[str, IntWeight | FloatWeight]]:
        """Each quantized module's prefix and weight, its tensors dropped once decoded."""
        for prefix in sorted(self._tensors):
            tensors = self._tensors.pop(prefix)
            try:
                yield prefix, self.format.decode(prefix, tensors)
            except ParamError:
                raise
            except KeyError as exc:
                raise ValueError(f"{self.format.method}: {prefix} lacks its {exc.args[0]!r} tensor") from exc
            except (RuntimeError, IndexError, ValueError) as exc:
                raise ParamError("quantization", f"{self.format.method}: {prefix}'s tensors "
                                 f"({', '.join(f'{k} {tuple(v.shape)}' for k, v in tensors.items())}) do not "
                                 f"fit its quantization_config ({exc})") from exc
