"""Checkpoint formats of quantized weights: which modules a checkpoint quantized, and each one's
tensors decoded to `IntWeight` / `FloatWeight` (weights.py). vLLM's `QuantizationConfig` half.

- `gptq` (AutoGPTQ / GPTQModel, format v1): `qweight` int32 [in * bits / 32, out] packing input
  features (feature 32/bits * r + j at bits j * bits of row r), `qzeros` int32 [groups, out * bits / 32]
  packing output channels the same way and stored minus one, `scales` [groups, out], `g_idx` [in]
  (each input feature's group: act order where it is not i // group_size). `checkpoint_format:
  gptq_v2` stores the zeros as they are.
- `awq` (AutoAWQ GEMM): `qweight` int32 [in, out / 8] packing output channels in AWQ's order (the
  eight nibbles of a word hold channels 0, 2, 4, 6, 1, 3, 5, 7), `qzeros` [groups, out / 8] likewise
  (not minus one), `scales` [groups, out].
- `compressed-tensors` (llm-compressor): `pack-quantized` (`weight_packed` int32 [out, in * bits / 32],
  signed values plus 2**(bits - 1), element i at bit i * bits; `weight_zero_point` packed over the
  output channels where asymmetric; `weight_g_idx` for act order), `int-quantized` (`weight` int8)
  and `float-quantized` (`weight` float8_e4m3fn), each with `weight_scale` per tensor, channel,
  group or block; W8A8's activations quantized per token at run time, FP8's per token or with a
  static `input_scale`. Which scheme a module has comes from the `config_groups` whose targets match
  it; modules in `ignore` are stored unquantized and load as such.
"""
from __future__ import annotations

import abc
from typing import Iterable

import torch

from treeserve.errors import ParamError
from treeserve.model.quantization.weights import FloatWeight, IntWeight


# int32 words unpacked at a time: the int32 values of a whole LM head (263 M) would be 1 GB at once, and
# small temporaries (4 MiB of int32 values here) stay in cache and in the heap: at 1 M words (32 MiB,
# mapped and faulted in anew each time) the 1B shape's GPTQ load took 7.6 s, at 64-128 K 3.3-3.5 s
UNPACK_CHUNK_WORDS = 1 << 17


def unpack_int32(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Values packed along the last dimension of int32 words, value j at bits j * bits (or, with
    `order`, value j of each word at bits order.index(j) * bits): [..., w] -> uint8 [..., w * 32 / bits],
    UNPACK_CHUNK_WORDS at a time."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if order is not None:
        shifts = shifts[[order.index(j) for j in range(per_word)]]
    rows = packed.reshape(-1, packed.shape[-1])
    out = torch.empty(rows.shape[0], rows.shape[1] * per_word, dtype=torch.uint8)
    step = max(1, UNPACK_CHUNK_WORDS // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        words = rows[start:start + step].to(torch.int32).unsqueeze(-1)
        out[start:start + step] = ((words >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    return out.reshape(*packed.shape[:-1], -1)


def _bits(value, where: str) -> int:
    if isinstance(value, bool) or value not in (4, 8):
        raise ParamError("quantization", f"{where}: {value!r} bits cannot be loaded (supported: 4 and 8)")
    return int(value)


def _checked_group_size(value, where: str):
    """A config's group size as vLLM reads it: -1 (one group per channel, also written 0 or null) or a
    positive integer of input features."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= -1):
        return value
    raise ParamError("quantization", f"{where}: group_size {value!r} cannot be loaded (supported: -1 for one "
                     "group per output channel, or a positive number of input features)")


def _scales(tensors: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    """The module's `name` scales as float32, refused where they cannot be scales: not floating point
    (a corrupt or mislabelled tensor) or not finite (every weight of its group would be NaN or inf)."""
    scales = tensors[name]
    if not scales.is_floating_point():
        raise ParamError("quantization", f"{where}'s {name!r} tensor is {scales.dtype}, not floating point: "
                         "the checkpoint is corrupt or not in the format its quantization_config names")
    scales = scales.float()
    if not bool(torch.isfinite(scales).all()):
        raise ParamError("quantization", f"{where}'s {name!r} tensor holds {int((~torch.isfinite(scales)).sum())} "
                         "NaN or infinite values: the checkpoint is corrupt")
    return scales


def _group_size(value, in_features: int) -> int:
    """Input features per group: all of them for -1 (one group per channel), or a group larger than
    the layer is wide."""
    return in_features if value in (None, -1, 0) else min(int(value), in_features)


def _plain_g_idx(g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    """The checkpoint's g_idx where it is not the default i // group_size (nor unset, all -1)."""
    if g_idx is None or bool((g_idx < 0).all()):
        return None
    g_idx = g_idx.to(torch.int64)
    return None if torch.equal(g_idx, torch.arange(len(g_idx)) // group_size) else g_idx


class CheckpointFormat(abc.ABC):
    """A checkpoint format's reader (vLLM's `QuantizationConfig`): which modules it quantized, their
    tensors decoded to one weight."""
    method = ""
    markers: tuple[str, ...] = ()   # a module holding one of these tensors is quantized
    tensors: tuple[str, ...] = ()   # every tensor of a quantized module this format reads

    def quantized_modules(self, names: Iterable[str]) -> set[str]:
        """The checkpoint's module prefixes whose weights are quantized."""
        return {name.rsplit(".", 1)[0] for name in names if name.rsplit(".", 1)[-1] in self.markers}

    def owns(self, prefix: str, suffix: str) -> bool:
        return suffix in self.tensors

    @abc.abstractmethod
    def decode(self, prefix: str, tensors: dict[str, torch.Tensor]) -> IntWeight | FloatWeight:
        """The weight of the module at `prefix` from its tensors (`self.tensors` that it has)."""


GPTQ_LAYOUTS = ("gptq", "gptq_v2")  # checkpoint_format: v1 (zeros stored minus one) and v2


class GPTQFormat(CheckpointFormat):
    method = "gptq"
    tensors = ("qweight", "qzeros", "scales", "g_idx")
    # any of them: a module missing its qweight is named for it (its other tensors are nothing else's)
    markers = tensors

    def __init__(self, config: dict):
        self.bits = _bits(config.get("bits", 4), "gptq")
        self.group_size = _checked_group_size(config.get("group_size", 128), "gptq")
        layout = str(config.get("checkpoint_format") or "gptq").lower()
        if config.get("is_marlin_format"):  # AutoGPTQ's older flag for the same layout
            layout = "marlin"
        if layout not in GPTQ_LAYOUTS:  # marlin, bitblas: permuted tensors under the same names
            raise ParamError("quantization", f"gptq checkpoint_format {layout!r} cannot be loaded (supported: "
                             f"{', '.join(map(repr, GPTQ_LAYOUTS))}; vLLM reads 'marlin' as its own 'marlin' method)")
        self.zeros_minus_one = layout != "gptq_v2"
        self.desc_act = bool(config.get("desc_act", False))

    def decode(self, prefix: str, tensors: dict[str, torch.Tensor]) -> IntWeight:
        values = unpack_int32(tensors["qweight"].t(), self.bits).contiguous()  # [out, in]
        group_size = _group_size(self.group_size, values.shape[1])
        # (read in order, act-ordered groups would be garbage; one group per channel has no order, as
        # vLLM reads desc_act with group_size -1)
        if self.desc_act and "g_idx" not in tensors and group_size < values.shape[1]:
            raise ParamError("quantization", f"gptq: {prefix} lacks its 'g_idx' tensor, which desc_act (act order) "
                             "needs to know each input feature's group")
        zeros = unpack_int32(tensors["qzeros"], self.bits)[:, :values.shape[0]].t().float()
        zeros = zeros + 1 if self.zeros_minus_one else zeros
        scales = _scales(tensors, "scales", f"{self.method}: {prefix}").t().contiguous()
        return IntWeight(values, scales, zeros.contiguous(), self.bits, group_size,
                         _plain_g_idx(tensors.get("g_idx"), group_size))


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # channel j of 8 sits in nibble AWQ_ORDER.index(j)


class AWQFormat(CheckpointFormat):
    method = "awq"
    tensors = ("qweight", "qzeros", "scales")
    markers = tensors  # (as GPTQ's)

    def __init__(self, config: dict):
        self.bits = _bits(config.get("bits", config.get("w_bit", 4)), "awq")
        if self.bits != 4:
            raise ParamError("quantization", f"awq: {self.bits} bits cannot be loaded (its GEMM packing is 4-bit)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ParamError("quantization", f"awq version {version!r} cannot be loaded (supported: 'gemm')")
        if config.get("zero_point", True) is False:
            raise ParamError("quantization", "awq without zero points cannot be loaded (supported: zero_point true)")
        self.group_size = _checked_group_size(config.get("group_size", config.get("q_group_size", 128)), "awq")

    def decode(self, prefix: str, tensors: dict[str, torch.Tensor]) -> IntWeight:
        values = unpack_int32(tensors["qweight"], 4, AWQ_ORDER)  # [in, out]
        zeros = unpack_int32(tensors["qzeros"], 4, AWQ_ORDER).float()
        group_size = _group_size(self.group_size, values.shape[0])
        scales = _scales(tensors, "scales", f"{self.method}: {prefix}").t().contiguous()
        return IntWeight(values.t().contiguous(), scales, zeros.t().contiguous(), 4, group_size)
