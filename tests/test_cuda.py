"""The CUDA path: the same engine on a GPU agrees with the CPU run (skipped without a GPU)."""
import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.model.attention import TorchSDPABackend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_backend_imports_and_is_device_agnostic():
    assert TorchSDPABackend.name == "torch_sdpa"


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_cuda_greedy_matches_cpu(tiny_model_dirs, family):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello there", "The water is", "café 日本語 😀"]
    path = str(tiny_model_dirs[family])
    cpu = LLM(path, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20).generate(prompts, params)
    gpu = LLM(path, dtype="float32", device="cuda", kv_cache_memory_bytes=8 << 20).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in cpu] == [o.outputs[0].token_ids for o in gpu]
