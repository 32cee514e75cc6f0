"""treeserve: a scalable runtime for LLM inference and test-time compute search."""
from treeserve.entrypoints.llm import LLM
from treeserve.outputs import CompletionOutput, Logprob, RequestOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "Runtime", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
