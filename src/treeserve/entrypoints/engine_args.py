"""vLLM's `LLM(...)` engine arguments that EngineConfig has no field for. Those whose vLLM meaning is
what treeserve always does are taken and have no effect; a value treeserve would not honour, or a
name it does not know, is a ParamError naming it (not a TypeError from EngineConfig's constructor)."""
from __future__ import annotations

import dataclasses

from treeserve.config import EngineConfig
from treeserve.errors import ParamError

ANY = object()  # every value means what treeserve does anyway
# name -> (the values that change nothing here, what treeserve does)
ALWAYS_SO = {
    "disable_log_stats": (ANY, "the offline API logs no periodic stats"),
    "enable_chunked_prefill": ((True, None), "a long prompt's prefill is always chunked (vLLM v1's default)"),
    "swap_space": (ANY, "a preempted request is recomputed, never swapped to CPU memory (as in vLLM v1)"),
    "tokenizer_mode": (("auto", "hf"), "the checkpoint's own Hugging Face tokenizer is used"),
    "revision": ((None,), "a model is a local directory or a bundled one: nothing is downloaded"),
    "tokenizer_revision": ((None,), "a model is a local directory or a bundled one: nothing is downloaded"),
    "enable_lora": ((False, None), "LoRA adapters are not supported"),
    "disable_custom_all_reduce": (ANY, "tensor-parallel ranks reduce with torch.distributed"),
    "trust_remote_code": (ANY, "no model code is loaded from a checkpoint: every architecture is built in"),
    "kv_cache_dtype": (("auto", None), "keys and values are stored in the model's dtype (fp8 KV is not supported)"),
}


def config_fields(options: dict, caller: str = "LLM") -> dict:
    """`options` less the vLLM arguments that change nothing here; ParamError for the rest that
    EngineConfig lacks (`caller`: the constructor the message names)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kept = {}
    for name, value in options.items():
        if name in fields:
            kept[name] = value
        elif name in ALWAYS_SO:
            _check_always_so(name, value)
        else:
            raise ParamError(name, f"is not an engine option here; {caller}(...) takes {', '.join(sorted(fields - {'model'}))}")
    return kept


def _check_always_so(name: str, value) -> None:
    taken, what = ALWAYS_SO[name]
    if taken is not ANY and value not in taken:
        raise ParamError(name, f"{value!r} cannot be honoured: {what} (leave it out)")
