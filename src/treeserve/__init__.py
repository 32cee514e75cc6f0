"""treeserve: a scalable runtime for LLM inference and test-time compute search.

The names below load on first use (PEP 562), so `import treeserve.gateway` (which talks to servers
over HTTP) does not import PyTorch and the engine."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
_EXPORTS = {"LLM": "treeserve.entrypoints.llm", "Runtime": "treeserve.runtime.runtime",
            "SamplingParams": "treeserve.sampling_params", "StructuredOutputsParams": "treeserve.sampling_params",
            "RequestOutputKind": "treeserve.sampling_params", "BeamSearchParams": "treeserve.sampling_params",
            "BeamSearchOutput": "treeserve.entrypoints.beam_search", "BeamSearchSequence": "treeserve.entrypoints.beam_search",
            "RequestOutput": "treeserve.outputs", "CompletionOutput": "treeserve.outputs", "Logprob": "treeserve.outputs",
            "TextPrompt": "treeserve.inputs", "TokensPrompt": "treeserve.inputs", "PromptType": "treeserve.inputs"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treeserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
