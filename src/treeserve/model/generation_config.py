"""A checkpoint's generation_config.json: its stop ids and the sampling defaults of its requests."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treeserve.errors import ParamError
from treeserve.model.hf_config import ModelConfig, read_json


@dataclass
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)


GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model_dir: Path, config: ModelConfig, source: str | Path = "auto") -> GenerationDefaults:
    """Stop ids and default sampling from a generation_config.json, as vLLM's `--generation-config`:
    "auto" reads the checkpoint's (its sampling fields become the defaults of requests that leave them
    out), "vllm" the checkpoint's stop ids only (treeserve's own sampling defaults), a folder its own
    generation_config.json."""
    folder = model_dir if str(source) in ("auto", "vllm") else Path(source)
    path = folder / "generation_config.json"
    if folder != model_dir and not path.is_file():
        raise ParamError("generation_config", f"{path}: file not found (give 'auto', 'vllm' or a folder holding one)")
    raw = read_json(path) if path.is_file() else {}
    eos = raw.get("eos_token_id", None)
    if eos is None:
        eos_ids = config.eos_token_ids
    else:
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos)
    sampling = {ours: raw[theirs] for theirs, ours in GENERATION_SAMPLING_KEYS.items() if raw.get(theirs) is not None}
    if raw.get("do_sample") is False:
        sampling["temperature"] = 0.0
    if str(source) == "vllm":
        sampling = {}
    return GenerationDefaults(eos_token_ids=tuple(int(e) for e in eos_ids), sampling=sampling)
