"""Demotion of asymmetric codes to a narrower width inside the group's range (kivi.quant.demote)."""

from __future__ import annotations

import pytest
import torch

from kivi.quant.demote import demote_codes, demote_kv, demote_ratio
from kivi.quant.kv import dequantize_kv, quantize_kv
from kivi.quant.packing import unpack_codes


@pytest.mark.parametrize("bits,to,r", [(4, 2, 5), (8, 4, 17), (8, 2, 85), (2, 1, 3), (4, 1, 15), (4, 4, 1)])
def test_ratio_and_nearest_level(bits, to, r):
    assert demote_ratio(bits, to) == r
    c = torch.arange(2**bits, dtype=torch.uint8)
    d = demote_codes(c, r)
    # the nearest level j * r of the narrower grid (r odd: never a tie)
    want = torch.argmin((c[:, None].float() - torch.arange(2**to).float()[None, :] * r).abs(), dim=1)
    assert torch.equal(d.long(), want)


def test_ratio_refuses_a_width_that_does_not_divide():
    with pytest.raises(ValueError, match="to_bits=3 must divide bits=4"):
        demote_ratio(4, 3)


@pytest.mark.parametrize("axis,T", [("channel", 64), ("token", 13)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_demoted_values_are_levels_of_the_same_range(axis, T, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, T, 64, generator=g).to(dtype)
    x[0, 0, :32 if axis == "channel" else 1] = 0.25  # an all-constant group (scale 0)
    p4 = quantize_kv(x, axis, 4, 32)
    p2 = demote_kv(p4, 2)
    assert p2.bits == 2 and p2.packed.shape[-1] == 64 // 4
    assert torch.equal(p2.offset, p4.offset)
    torch.testing.assert_close(p2.scale.float(), (p4.scale.float() * 5).to(dtype).float(), rtol=0, atol=0)
    c4 = unpack_codes(p4.packed, 4, 64).long()
    c2 = unpack_codes(p2.packed, 2, 64).long()
    assert torch.equal(c2, (c4 + 2) // 5)
    # error bound: |x4 - x2| <= 2 * scale4 (half a 2-bit step) + 3 * |5 * scale4 - scale2| (the one
    # rounding of the stored scale), up to float32 arithmetic
    x4, x2 = dequantize_kv(p4), dequantize_kv(p2)
    dim = 2 if axis == "channel" else 3
    s4 = p4.scale.float().repeat_interleave(32, dim=dim)
    s2 = p2.scale.float().repeat_interleave(32, dim=dim)
    assert bool(((x4 - x2).abs() <= 2 * s4 + 3 * (5 * s4 - s2).abs() + 1e-6 * (1 + x4.abs())).all())
    # the constant group stays exact
    sl = (0, 0, slice(0, 32 if axis == "channel" else 1))
    assert torch.equal(x2[sl], x4[sl])


def test_demote_refuses_symmetric_codes():
    p = quantize_kv(torch.randn(1, 1, 32, 32), "channel", 4, 32, symmetric=True)
    with pytest.raises(ValueError, match="asymmetric"):
        demote_kv(p, 2)
