"""csrc/int4_linear.c (group-quantized 4-bit weights times bfloat16 rows) against the dequantized
weight in float64: every tile height, a short last channel block, group sizes 32 to the whole row,
asymmetric zero points, strided rows; and refusals where it cannot run."""
import pytest
import torch

from treeserve.model import cpu_kernels, linear_kernels

LIBRARY = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIBRARY is None or LIBRARY.ts_int4_supported() != 1,
                                reason="hardware: no AVX512-BF16 here (or no C compiler): the 4-bit kernel is not built")


def _weights(n, k, group_size, gen):
    q = torch.randint(0, 16, (n, k), generator=gen)
    groups = k // group_size
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, groups), generator=gen).float()
    dense = (q.double() - zeros.double().repeat_interleave(group_size, 1)) * scales.double().repeat_interleave(group_size, 1)
    return q, scales, zeros, dense


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("n,k,group_size", [(22, 256, 32), (64, 512, 128), (8, 384, 384), (6, 768, 64),
                                             (10, 160, 32), (4, 96, 96)])  # short last runs of the layout
def test_int4_linear_matches_the_dequantized_weight(rows, n, k, group_size):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q, scales, zeros, dense = _weights(n, k, group_size, gen)
    wide = (torch.randn(rows, k + 32, generator=gen) * 3).to(torch.bfloat16)
    wide[:, 40] = 60.0  # an outlier, as activations have: the offset sums must not cancel it away
    x = wide[:, 16:16 + k]  # rows k + 32 elements apart
    out = linear_kernels.int4_linear(LIBRARY, x, linear_kernels.int4_pack(q), scales, zeros, group_size)
    expected = x.double() @ dense.T
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # float32 sums of exact products, rounded once to bfloat16
    torch.testing.assert_close(out.double(), expected, atol=2e-3 * expected.abs().max().item(), rtol=8e-3)


PACKED16 = LIBRARY is not None and LIBRARY.ts_int8_rows16() == 1
needs_packed16 = pytest.mark.skipif(not PACKED16, reason="hardware: no AVX512-VNNI here (the packed 4-bit kernel "
                                                         "multiplies 16-bit rows by vpdpwssd)")


@needs_packed16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 48, 53, 64])
@pytest.mark.parametrize("n,k,group_size", [(22, 256, 32), (70, 512, 128), (8, 288, 288), (6, 1024, 512),
                                             (10, 160, 32), (4, 96, 96), (70, 2304, 96), (66, 2080, 2080)])
def test_packed_int4_linear_matches_the_dequantized_weight(rows, n, k, group_size):
    """The packed layout: with 16-bit rows below 48 rows (every tile height and more), widened to
    bfloat16 span by span from 48 on (tiles of 6 and a shorter last one; rows longer than a span
    of 1024, groups across the spans' ends); channels past a block of 64, groups from 32 inputs to
    the whole row (spans of 256 where a group is longer: 288 is one group, spans 256 + 32), an outlier."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q, scales, zeros, dense = _weights(n, k, group_size, gen)
    strided = (torch.randn(rows, k + 32, generator=gen) * 3).to(torch.bfloat16)
    strided[:, 40] = 60.0
    x = strided[:, 16:16 + k]
    assert LIBRARY.ts_int4_wide_rows() == 48
    assert LIBRARY.ts_int4_packed16_span(k, group_size) == min(group_size, 256)
    out = linear_kernels.int4_linear_packed16(LIBRARY, x, linear_kernels.int4_pack16(q.to(torch.uint8)),
                                           linear_kernels.int4_pack16_groups(scales),
                                           linear_kernels.int4_pack16_groups(zeros), n, group_size)
    wide = 0 < LIBRARY.ts_int4_wide_rows() <= rows  # weights widened, rounded to bfloat16 once (as a model's)
    expected = x.double() @ (dense.to(torch.bfloat16).double() if wide else dense).T
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, atol=2e-3 * expected.abs().max().item(), rtol=8e-3)


@needs_packed16
def test_int4_pack16_reads_back_and_refuses_spans_it_cannot_take():
    q = torch.randint(0, 16, (70, 256), dtype=torch.uint8)
    assert torch.equal(linear_kernels.int4_unpack16(linear_kernels.int4_pack16(q), 70, 256), q)
    tall = torch.randint(0, 16, (200, 64), dtype=torch.uint8)  # 4 blocks, the last part zeros
    packed = linear_kernels.int4_pack16(tall, blocks_at_once=3)  # packed 3 blocks, then 1
    assert torch.equal(packed, linear_kernels.int4_pack16(tall)) and packed.numel() == 256 * 64 // 2
    assert torch.equal(linear_kernels.int4_unpack16(packed, 200, 64), tall)
    assert not linear_kernels.int4_unpack16(packed, 256, 64)[200:].any()
    assert LIBRARY.ts_int4_packed16_span(768, 384) == 0  # longer than 256, not a multiple of it, not the row
    assert LIBRARY.ts_int4_packed16_span(768, 48) == 0


def test_int4_pack_layout_and_dequantize():
    gen = torch.Generator().manual_seed(1)
    q, scales, zeros, dense = _weights(6, 192, 32, gen)
    packed = linear_kernels.int4_pack(q)
    assert packed.shape == (6, 64) and packed.dtype == torch.uint16
    word = int(packed[0, 33].view(torch.int16)) & 0xFFFF  # run 1, word 1: inputs 129, 161 (and zeros past 192)
    assert word == int(q[0, 129]) | int(q[0, 161]) << 4
    out = linear_kernels.int4_dequantize(LIBRARY, packed, scales, zeros, 32, torch.empty(6, 192, dtype=torch.bfloat16))
    assert torch.equal(out, dense.float().to(torch.bfloat16))


def test_int4_kernel_refuses_what_it_cannot_run_and_takes_no_rows():
    q, scales, zeros, _ = _weights(4, 128, 32, torch.Generator().manual_seed(2))
    packed = linear_kernels.int4_pack(q)
    x = torch.randn(2, 128).to(torch.bfloat16)
    assert linear_kernels.int4_linear(LIBRARY, x.float(), packed, scales, zeros, 32) is None  # float32 rows
    assert linear_kernels.int4_linear(LIBRARY, x, packed, scales[:, :1], zeros[:, :1], 48) is None  # 48: not a multiple of 32
    empty = linear_kernels.int4_linear(LIBRARY, x[:0], packed, scales, zeros, 32)  # no rows: an empty product
    assert empty is not None and empty.shape == (0, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        linear_kernels.int4_pack(torch.zeros(2, 48, dtype=torch.int32))
