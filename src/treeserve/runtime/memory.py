"""Memory accounting as the founding study measures it, per model:

    KV = total x utilisation - (activations + weights + non-torch)
    blocks = KV / (block_size x bytes per token per layer x layers)

Weights are the parameters' bytes; activations are the peak of live tensor bytes during a dry run
of one `max_num_batched_tokens` prefill (CUDA: the allocator's peak; CPU: tracked per tensor);
non-torch memory is what the process holds outside tensors (CUDA: in use on the device but not
reserved by PyTorch; CPU: resident set minus tensor bytes).
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.loaded_model import LoadedModel
from treeserve.sampling_params import SamplingParams


@dataclass
class MemoryBreakdown:
    model: str
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    kv_bytes: int = 0
    kv_blocks: int = 0
    block_size: int = 0
    kv_bytes_per_token: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def weights_bytes(model: LoadedModel | LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.parameters())


class _LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the mode (storages that existed before are ignored)."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        # (oneDNN-packed weights are opaque tensors with no storage to read: they are not activations)
        self._known = {t.untyped_storage().data_ptr() for t in existing if not t.is_mkldnn}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing under this mode is compiled; torch's wrapper (to keep Dynamo out of the dispatch)
        # would import torch._dynamo on the first op: ~2.5 s of every server's start.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.is_mkldnn:
            return
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._known or size == 0:
            return
        self._known.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._known.discard(key)
        self.live -= size


def measure_activation_bytes(model: LoadedModel) -> int:
    """Dry run: one prefill of `max_num_batched_tokens` tokens by an engine over a scratch KV space,
    dropped afterwards (the engine that serves is built over the real space)."""
    tokens = min(model.max_num_batched_tokens, model.max_model_len - 1)
    page = model.config.block_size * model.kv_bytes_per_token()
    scratch = KVSpace.create(page * (tokens // model.config.block_size + 2), page, model.device, False)
    engine = LLMEngine(model, scratch, scratch=True)
    prompt = [1 + i % (model.model_config.vocab_size - 1) for i in range(tokens)]
    loop = EngineLoop(engine)
    loop.add_request(engine, "memory-dry-run", prompt, SamplingParams(max_tokens=1), lambda output: None,
                     logits_positions=[tokens - 1])
    existing = list(model.model.parameters()) + [scratch.arena.pages]
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
        base = torch.cuda.memory_allocated(model.device)
        loop.run_until(lambda: not engine.has_unfinished_requests())
        return torch.cuda.max_memory_allocated(model.device) - base
    tracker = _LiveTensorBytes(existing)
    with tracker:
        loop.run_until(lambda: not engine.has_unfinished_requests())
    return tracker.peak


def non_torch_bytes(models: list[LoadedModel]) -> int:
    device = models[0].device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, (total - free) - torch.cuda.memory_reserved(device))
    tensor_bytes = sum(weights_bytes(m) for m in models)
    return max(0, _resident_bytes() - tensor_bytes)


def _resident_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    import resource

    return pages * resource.getpagesize()


def format_breakdown(rows: list[MemoryBreakdown], total: int, utilisation: float | None) -> str:
    """The table `treeserve memory` prints (`utilisation` None: the KV budget was a share of `total` alone,
    `cpu_kv_memory_fraction`)."""
    mib = 1 << 20
    first = (f"total {total / mib:,.0f} MiB x utilisation {utilisation:.2f} = {total * utilisation / mib:,.0f} MiB"
             if utilisation is not None else f"total {total / mib:,.0f} MiB available (KV: cpu_kv_memory_fraction of it)")
    lines = [first,
             f"{'model':<12}{'weights':>12}{'activations':>14}{'non-torch':>12}{'KV':>12}{'blocks':>9}"
             f"{'tokens/blk':>12}{'B/token':>10}"]
    for r in rows:
        lines.append(f"{r.model:<12}{r.weights_bytes / mib:>10.1f}Mi{r.activation_bytes / mib:>12.1f}Mi"
                     f"{r.non_torch_bytes / mib:>10.1f}Mi{r.kv_bytes / mib:>10.1f}Mi{r.kv_blocks:>9}"
                     f"{r.block_size:>12}{r.kv_bytes_per_token:>10}")
    return "\n".join(lines)
