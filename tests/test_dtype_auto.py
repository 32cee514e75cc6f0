"""`dtype="auto"`: what each device runs a checkpoint in (vLLM's rule on a GPU, speed's rule on a CPU)."""
import pytest
import torch

from treeserve import config
from treeserve.config import EngineConfig

CUDA = torch.device("cuda")


@pytest.mark.parametrize("checkpoint, bf16_units, expected", [
    ("float32", True, torch.bfloat16),     # vLLM downcasts a float32 checkpoint to the device's half type
    (None, True, torch.bfloat16),          # no torch_dtype in config.json reads as float32
    ("float32", False, torch.float16),     # before compute capability 8.0: float16
    ("bfloat16", True, torch.bfloat16),
    ("bfloat16", False, torch.float16),    # bfloat16 weights on a GPU without bfloat16 units
    ("float16", True, torch.float16),
    ("float16", False, torch.float16),
])
def test_auto_on_a_gpu_runs_a_checkpoint_in_the_devices_half_type_as_vllm_does(monkeypatch, checkpoint, bf16_units,
                                                                                 expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_units)
    assert EngineConfig(model=".").resolve_dtype(CUDA, checkpoint) == expected


def test_an_explicit_dtype_wins_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert EngineConfig(model=".", dtype="float32").resolve_dtype(CUDA, "float32") == torch.float32


@pytest.mark.parametrize("bf16_units, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_a_cpu_picks_bfloat16_only_with_bfloat16_units(monkeypatch, bf16_units, expected):
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: bf16_units)
    for checkpoint in ("float32", "bfloat16", None):
        assert EngineConfig(model=".").resolve_dtype(torch.device("cpu"), checkpoint) == expected
