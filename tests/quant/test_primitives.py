import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi.quant.primitives import SUPPORTED_BITS, dequantize_groups, fake_quantize, quantize_groups


def _roundtrip(x, bits, g, axis, symmetric=False):
    codes, scale, offset = quantize_groups(x, bits, g, axis, symmetric=symmetric)
    y = dequantize_groups(codes, scale, offset, bits, g, axis, dtype=torch.float32)
    return codes, scale, offset, y


def _step_per_element(scale, g, axis, shape):
    return scale.float().repeat_interleave(g, dim=axis % len(shape))


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(SUPPORTED_BITS),
    g=st.sampled_from([1, 2, 8, 32]),
    ngroups=st.integers(1, 4),
    other=st.integers(1, 13),
    axis=st.sampled_from([0, 1]),
    log_mag=st.floats(-20, 20),
    seed=st.integers(0, 2**16),
)
def test_error_within_half_step(bits, g, ngroups, other, axis, log_mag, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = [other, other]
    shape[axis] = g * ngroups
    x = torch.randn(shape, generator=gen, dtype=torch.float64).float() * (10.0**log_mag) + 3.0 * 10.0**log_mag
    codes, scale, offset, y = _roundtrip(x, bits, g, axis)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2**bits
    step = _step_per_element(scale, g, axis, shape)
    err = (x - y).abs()
    assert torch.all(err <= step / 2 + 1e-5 * x.abs().amax() + 1e-30)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_constant_groups_round_trip_exactly(bits, dtype):
    x = torch.full((3, 64), 0.7, dtype=dtype)
    x[1] = -12.5
    x[2, :32] = 1e-3
    codes, scale, offset = quantize_groups(x, bits, 32, -1)
    assert torch.all(scale == 0)
    y = dequantize_groups(codes, scale, offset, bits, 32, -1, dtype=dtype)
    assert torch.equal(y, x)  # the KIVI reference gives NaN here (0/0)


def test_symmetric_error_bound_and_levels():
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    codes, scale, offset, y = _roundtrip(x, 2, 32, -1, symmetric=True)
    assert offset is None
    assert set(codes.unique().tolist()) <= {0, 1, 2}  # -s, 0, +s
    step = _step_per_element(scale, 32, -1, x.shape)
    assert torch.all((x - y).abs() <= step / 2 + 1e-6)


def test_asymmetric_beats_symmetric_on_skewed_data():
    torch.manual_seed(0)
    x = torch.rand(64, 128) * 4 + 1  # all positive: symmetric wastes half its levels
    e_asym = (fake_quantize(x, 2, 32) - x).pow(2).mean()
    e_sym = (fake_quantize(x, 2, 32, symmetric=True) - x).pow(2).mean()
    assert e_asym < 0.5 * e_sym


def test_valid_mask_excludes_padding_from_statistics():
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    valid = torch.ones(4, 32, dtype=torch.bool)
    valid[:, :5] = False
    a = x.clone()
    a[:, :5] = 1e4
    b = x.clone()
    b[:, :5] = -7.0
    ca, sa, oa = quantize_groups(a, 2, 32, -1, valid=valid)
    cb, sb, ob = quantize_groups(b, 2, 32, -1, valid=valid)
    assert torch.equal(sa, sb) and torch.equal(oa, ob)
    assert torch.equal(ca[:, 5:], cb[:, 5:])
    # padded positions get codes in range, never NaN
    ya = dequantize_groups(ca, sa, oa, 2, 32, -1)
    assert torch.isfinite(ya).all()


def test_all_padding_group_is_finite():
    x = torch.randn(2, 32)
    codes, scale, offset = quantize_groups(x, 2, 32, -1, valid=torch.zeros(2, 32, dtype=torch.bool))
    assert torch.all(scale == 0) and torch.all(offset == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(2, 32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_groups(x, 2, 32, -1)


def test_non_finite_poisons_only_its_group_when_unchecked():
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    y = dequantize_groups(*quantize_groups(x, 2, 32, -1, check_finite=False), 2, 32, -1)
    assert torch.isnan(y[1, :32]).all() and torch.isfinite(y[1, 32:]).all() and torch.isfinite(y[0]).all()


@pytest.mark.parametrize("bits", [0, 5, 16, True, 2.0])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits="):
        quantize_groups(torch.randn(2, 32), bits, 32)


def test_bad_group_size_and_length():
    with pytest.raises(ValueError, match="group_size=0"):
        quantize_groups(torch.randn(2, 32), 2, 0)
    with pytest.raises(ValueError, match="not a multiple of group_size=32"):
        quantize_groups(torch.randn(2, 40), 2, 32)
    with pytest.raises(ValueError, match="symmetric"):
        quantize_groups(torch.randn(2, 32), 1, 32, symmetric=True)


def test_more_bits_less_error():
    torch.manual_seed(1)
    x = torch.randn(16, 256)
    errs = [(fake_quantize(x, b, 32) - x).pow(2).mean().item() for b in (1, 2, 3, 4, 8)]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert math.isclose(errs[-1], 0.0, abs_tol=1e-4)
