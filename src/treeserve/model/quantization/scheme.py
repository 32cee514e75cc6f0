"""Which quantization scheme a model runs with, as vLLM resolves `quantization`: by default what the
checkpoint's `quantization_config` says; asking for another, or for a scheme treeserve cannot load,
is a `ParamError` naming it."""
from __future__ import annotations

from pathlib import Path

import torch

from treeserve.errors import ParamError
from treeserve.model.hf_config import read_json
from treeserve.model.quantization.compressed_tensors import CompressedTensorsFormat
from treeserve.model.quantization.formats import AWQFormat, CheckpointFormat, GPTQFormat

ON_THE_FLY_METHODS = ("int8",)  # made at load from a float or bfloat16 checkpoint
CHECKPOINT_FORMATS = {"gptq": GPTQFormat, "awq": AWQFormat, "compressed-tensors": CompressedTensorsFormat}
QUANTIZATION_METHODS = ON_THE_FLY_METHODS + tuple(CHECKPOINT_FORMATS)  # what `quantization` may name
# vLLM's names for kernels of the same checkpoints
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}


def checkpoint_method(model_dir: Path) -> tuple[str | None, dict]:
    """The checkpoint's own scheme (`quantization_config.quant_method`, lower case) and its config."""
    path = Path(model_dir) / "config.json"
    config = (read_json(path) if path.is_file() else {}).get("quantization_config") or {}
    method = config.get("quant_method") or config.get("quant_type") or ("unknown" if config else None)
    return (str(method).lower() if method else None), config


def resolve_quantization(requested: str | None, model_dir: Path) -> str | None:
    """The scheme this model runs with; a clear error for one that cannot be loaded."""
    requested = None if requested == "none" else ALIASES.get(requested, requested)  # none: as stored
    stored, details = checkpoint_method(model_dir)
    if stored is not None:
        if requested is not None and requested != stored:
            raise ParamError("quantization", f"{requested!r} was asked for, but the checkpoint is quantized with "
                             f"{stored!r}: pass the checkpoint's method or none")
        if stored not in CHECKPOINT_FORMATS:
            bits = f", {details['bits']} bits" if "bits" in details else ""
            raise ParamError("quantization", f"the checkpoint is quantized with {stored!r}{bits}, which treeserve "
                             f"cannot load yet (supported: {', '.join(CHECKPOINT_FORMATS)} checkpoints; "
                             f"{', '.join(ON_THE_FLY_METHODS)} on the fly from a float or bfloat16 checkpoint)")
        checkpoint_format(model_dir, stored)  # its settings checked now, before anything is built
        return stored
    if requested is not None and requested not in ON_THE_FLY_METHODS:
        named = f"{requested!r} names a checkpoint format, and this checkpoint is not quantized" \
            if requested in CHECKPOINT_FORMATS else f"got {requested!r}"
        raise ParamError("quantization", f"must be one of {', '.join(ON_THE_FLY_METHODS)} (or none) for an "
                         f"unquantized checkpoint; {named}")
    return requested


def checkpoint_format(model_dir: Path, method: str) -> CheckpointFormat | None:
    """The reader of this checkpoint's quantized tensors (None for a scheme made on the fly)."""
    if method not in CHECKPOINT_FORMATS:
        return None
    return CHECKPOINT_FORMATS[method](checkpoint_method(model_dir)[1])


def check_device(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """What the scheme's kernels run on so far (a clear error for the rest); any tensor parallel size
    (each rank slices the decoded weights, model/sharding.py)."""
    if method is None:
        return
    if device.type != "cpu":
        raise ParamError("quantization", f"{method} runs on CPU so far, not {device.type}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ParamError("quantization", f"{method} needs float32 or bfloat16 activations, not {dtype}")
