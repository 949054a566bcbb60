"""Triton quantize + pack vs the torch reference `kivi.quant.kv.quantize_kv` (TRITON_INTERPRET=1, CPU)."""

from __future__ import annotations

import pytest
import torch

from kivi.kernels import quantize_pack_keys, quantize_pack_values
from kivi.quant.kv import dequantize_kv, quantize_kv, quantize_side
from kivi.quant.packing import unpack_codes
from kivi.quant.side_format import SideFormat

pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def keys(bits: int, group: int, **kw) -> SideFormat:
    return SideFormat("channel", bits, group, **kw)


def values(bits: int, group: int, **kw) -> SideFormat:
    return SideFormat("token", bits, group, **kw)


def _compare(got, ref, x, bits):
    """Fields match the reference; codes may differ by one at a tiny fraction (float rounding ties)."""
    assert got.packed.shape == ref.packed.shape and got.packed.dtype == torch.uint8
    assert got.scale.shape == ref.scale.shape and got.scale.dtype == ref.scale.dtype
    assert got.offset.dtype == ref.offset.dtype
    assert (got.axis, got.bits, got.group_size, got.head_dim, got.comp) == (ref.axis, ref.bits, ref.group_size,
                                                                            ref.head_dim, None)
    D = x.shape[-1]
    cg = unpack_codes(got.packed, bits, D).int()
    cr = unpack_codes(ref.packed, bits, D).int()
    diff = (cg - cr).abs()
    assert int(diff.max()) <= 1
    assert int((diff > 0).sum()) <= max(1, cg.numel() // 1000)
    torch.testing.assert_close(
        got.scale.float(), ref.scale.float(), rtol=1e-2 if x.dtype != torch.float32 else 1e-6, atol=0
    )
    torch.testing.assert_close(
        got.offset.float(), ref.offset.float(), rtol=1e-2 if x.dtype != torch.float32 else 1e-6, atol=0
    )
    # error bound against the input, everywhere: |x - x_hat| <= scale / 2 (+ parameter rounding)
    xh = dequantize_kv(got, torch.float32)
    levels = 2**bits - 1
    if got.axis == "channel":
        s = got.scale.float().repeat_interleave(got.group_size, dim=-2)
        o = got.offset.float().repeat_interleave(got.group_size, dim=-2)
    else:
        s = got.scale.float().repeat_interleave(got.group_size, dim=-1)
        o = got.offset.float().repeat_interleave(got.group_size, dim=-1)
    eps = torch.finfo(x.dtype).eps
    bound = s / 2 + eps * (x.float().abs() + o.abs() + levels * s) + 1e-6
    assert bool(((x.float() - xh).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_keys_match_reference(dtype, bits):
    torch.manual_seed(bits)
    k = (torch.randn(2, 3, 64, 40) * 3 + 1).to(dtype)  # D = 40: not a power of two
    got = quantize_pack_keys(k, keys(bits, 32))
    _compare(got, quantize_kv(k, "channel", bits, 32), k, bits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_values_match_reference(dtype, bits):
    torch.manual_seed(10 + bits)
    v = (torch.randn(2, 3, 67, 48) * 2).to(dtype)  # odd token count, 3 groups of 16 channels
    got = quantize_pack_values(v, values(bits, 16))
    _compare(got, quantize_kv(v, "token", bits, 16), v, bits)


@pytest.mark.parametrize("bits", [1, 8])
def test_other_widths(bits):
    torch.manual_seed(3)
    x = torch.randn(1, 2, 32, 32)
    _compare(quantize_pack_keys(x, keys(bits, 16)), quantize_side(x, keys(bits, 16)), x, bits)
    _compare(
        quantize_pack_values(x[:, :, :13], values(bits, 8)), quantize_kv(x[:, :, :13], "token", bits, 8), x[:, :, :13],
        bits
    )


def test_non_power_of_two_group_and_param_dtype():
    torch.manual_seed(4)
    k = torch.randn(1, 2, 48, 24, dtype=torch.float16)
    got = quantize_pack_keys(k, keys(2, 24, scale_dtype=torch.float32))
    ref = quantize_kv(k, "channel", 2, 24, param_dtype=torch.float32)
    assert got.scale.dtype == torch.float32
    _compare(got, ref, k, 2)
    v = torch.randn(1, 2, 5, 24, dtype=torch.bfloat16)
    _compare(quantize_pack_values(v, values(4, 12)), quantize_kv(v, "token", 4, 12), v, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups_round_trip_exactly(dtype):
    k = torch.full((1, 2, 32, 16), 0.3).to(dtype)
    k[:, 1] = -2.5
    k[0, 0, :, 3] = torch.linspace(-1, 1, 32)  # one non-constant channel
    pk = quantize_pack_keys(k, keys(2, 32))
    const = torch.ones(16, dtype=torch.bool)
    const[3] = False
    assert bool((pk.scale[0, 0, 0, const] == 0).all()) and bool((pk.scale[0, 1] == 0).all())
    xh = dequantize_kv(pk, dtype)
    assert torch.equal(xh[0, 0][:, const], k[0, 0][:, const]) and torch.equal(xh[0, 1], k[0, 1])
    v = torch.full((1, 2, 13, 32), 1.75).to(dtype)
    pv = quantize_pack_values(v, values(2, 16))
    assert bool((pv.scale == 0).all()) and bool((pv.packed == 0).all())
    assert torch.equal(dequantize_kv(pv, dtype), v)


def test_valid_mask_leaves_padding_out():
    torch.manual_seed(5)
    x = torch.randn(2, 2, 32, 16)
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[0, :7] = False  # left padding
    valid[1, :] = False  # nothing valid: scale 0, offset 0
    x[0, :, :7] = 100.0
    for axis, fn in (("channel", quantize_pack_keys), ("token", quantize_pack_values)):
        got = fn(x, SideFormat(axis, 2, 16), valid=valid)
        ref = quantize_kv(x, axis, 2, 16, valid=valid)
        assert torch.equal(got.packed, ref.packed)
        torch.testing.assert_close(got.scale, ref.scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.offset, ref.offset, rtol=1e-6, atol=0)


def test_rejects_unsupported():
    x = torch.randn(1, 1, 32, 16)
    with pytest.raises(NotImplementedError, match="asymmetric"):
        quantize_pack_keys(x, keys(2, 32, symmetric=True))
    with pytest.raises(NotImplementedError, match="compensation"):
        quantize_pack_values(x, values(2, 16, residual_bits=2))
    with pytest.raises(NotImplementedError, match="clip"):
        quantize_pack_values(x, values(2, 16, clip=True))
    with pytest.raises(NotImplementedError, match="rotation='hadamard'"):
        quantize_pack_keys(x, keys(2, 32, rotation="hadamard"))
    with pytest.raises(ValueError, match="fmt must be a SideFormat of axis 'token'"):
        quantize_pack_values(x, keys(2, 16))
    with pytest.raises(ValueError, match=r"bits=3: this Triton kernel supports bits in \[1, 2, 4, 8\].*quantize_kv"):
        quantize_pack_keys(x, keys(3, 32))  # the quantize kernels write word widths only (attention reads 3 bits)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_pack_keys(x[:, :, :13], keys(2, 32))
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_pack_values(x, values(2, 12))
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_pack_keys(bad, keys(2, 32))
    quantize_pack_keys(bad, keys(2, 32, check_finite=False))  # the format lets a NaN poison its group


def test_the_result_carries_the_format_as_the_reference_does():
    x = torch.randn(1, 2, 32, 16, dtype=torch.bfloat16)
    for fmt, fn in ((keys(2, 16), quantize_pack_keys), (values(4, 8, scale_dtype=torch.float32), quantize_pack_values)):
        got, ref = fn(x, fmt), quantize_side(x, fmt)
        assert got.format == ref.format == fmt and got.scale.dtype == ref.scale.dtype
        assert torch.equal(got.packed, ref.packed)
