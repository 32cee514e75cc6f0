"""csrc/w8a8_linear.c (W8A8: rows quantized to int8 per token, int8 weights, vpdpbusd) against the
same product computed by PyTorch (`quantize_rows_int8` + `torch._int_mm` + the float32 scaling):
the same bits, at every tile height, across spans of inputs, a short last channel block, zero rows,
strided rows, float32 and bfloat16; and the layer that packs its weight for it."""
import pytest
import torch

from treeserve.model import cpu_kernels, linear_kernels
from treeserve.model.quantization.activations import Int8W8A8Linear, quantize_rows_int8
from treeserve.model.quantization.weights import IntWeight

LIBRARY = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIBRARY is None or LIBRARY.ts_w8a8_supported() != 1,
                                reason="hardware: no AVX512-VNNI here (or no C compiler): the W8A8 kernel is not built")


def _reference(x, weight, scales):
    quantized, row_scales = quantize_rows_int8(x)
    scaled = torch._int_mm(weight, quantized.t()).float().mul_(scales[:, None]).mul_(row_scales.t())
    return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype).copy_(scaled.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 16])
@pytest.mark.parametrize("n,k", [(64, 256), (70, 36), (200, 1028), (16, 4)])  # 1028: five spans, a short last
def test_w8a8_linear_gives_pytorchs_bits(dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-4
    wide = (torch.randn(rows, k + 24, generator=gen) * 3).to(dtype)
    wide[:, 20] = 90.0  # an outlier, as activations have: the other values take few levels
    if rows > 2:
        wide[1] = 0.0  # a row of zeros: its scale is float32's epsilon
    x = wide[:, 12:12 + k]  # rows k + 24 elements apart
    packed, comp = linear_kernels.w8a8_pack(weight, LIBRARY.ts_w8a8_block_channels())
    out = linear_kernels.w8a8_linear(LIBRARY, x, packed, comp, scales, n)
    expected = _reference(x.contiguous(), weight, scales)
    assert out is not None and out.dtype == dtype and out.shape == (rows, n)
    assert torch.equal(out, expected)


def test_w8a8_pack_layout():
    weight = torch.arange(2 * 8, dtype=torch.int8).reshape(2, 8)
    packed, comp = linear_kernels.w8a8_pack(weight, 16)
    blocks = packed.reshape(1, 2, 16, 4)  # [blocks][k / 4][channels][4]
    assert blocks[0, 1, 1].tolist() == [12, 13, 14, 15]  # channel 1, inputs 4..7
    assert blocks[0, 0, 2:].abs().sum() == 0  # channels past n are zeros
    assert comp.tolist() == [128 * sum(range(8)), 128 * sum(range(8, 16))]


def test_the_layer_packs_its_weight_and_keeps_its_bias():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 256, (48, 128), dtype=torch.uint8, generator=gen)
    scales = torch.rand(48, 1, generator=gen) * 0.01
    weight = IntWeight(values, scales, torch.full_like(scales, 128.0), bits=8, group_size=128, input_quant="int8_token")
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    layer = Int8W8A8Linear(weight, bias, torch.bfloat16)
    assert layer.comp is not None and layer.weight.numel() == 64 * 128  # one block of 64 channels, zero-padded
    x = torch.randn(2, 3, 128, generator=gen).to(torch.bfloat16)
    signed = (values.to(torch.int16) - 128).to(torch.int8)
    expected = _reference(x.reshape(-1, 128), signed, scales[:, 0]) + bias
    assert torch.equal(layer(x), expected.reshape(2, 3, 48))


def test_given_row_scales_replace_the_rows_own():
    """A tensor-parallel rank's share of a row is scaled by the whole row's maximum."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randint(-128, 128, (80, 64), dtype=torch.int8, generator=gen)
    scales = torch.rand(80, generator=gen) * 0.01
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    row_scales = x.float().abs().amax(dim=1, keepdim=True) * torch.linspace(1.0, 3.0, 7)[:, None] / 127.5
    packed, comp = linear_kernels.w8a8_pack(weight, LIBRARY.ts_w8a8_block_channels())
    out = linear_kernels.w8a8_linear(LIBRARY, x, packed, comp, scales, 80, row_scales.reshape(-1).contiguous())
    quantized, _ = quantize_rows_int8(x, row_scales)
    expected = torch._int_mm(weight, quantized.t()).float().mul_(scales[:, None]).mul_(row_scales.t())
    assert torch.equal(out, expected.t().to(torch.bfloat16))
    assert not torch.equal(out, _reference(x, weight, scales))
