"""MSE-optimal clipping (kivi.quant.clipping) inside quantize_groups / quantize_kv."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi.quant.clipping import SHRINKS, clipped_params
from kivi.quant.kv import dequantize_kv, quantize_kv
from kivi.quant.primitives import dequantize_groups, group_view, quantize_groups

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def group_sq_err(x, bits, G, axis, *, clip, valid=None):
    """Per-group squared error of what is stored (parameters in x.dtype), valid elements only."""
    codes, scale, offset = quantize_groups(x, bits, G, axis, valid=valid, clip=clip)
    xh = dequantize_groups(codes, scale, offset, bits, G, axis)
    d = (xh - x.float()) ** 2
    if valid is not None:
        d = d * torch.broadcast_to(valid, x.shape)
    ax = axis % x.dim()
    return group_view(d, ax, G).sum(ax + 1)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    G=st.sampled_from([3, 8, 13, 32]),
    groups=st.integers(1, 3),
    rows=st.integers(1, 5),
    axis=st.sampled_from([0, 1]),
    dtype=st.sampled_from(DTYPES),
    heavy=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_clipping_never_increases_a_groups_error(bits, G, groups, rows, axis, dtype, heavy, masked, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (G * groups, rows) if axis == 0 else (rows, G * groups)
    x = torch.randn(shape, generator=g)
    if heavy:  # a few large entries: where clipping pays
        x = x * torch.where(torch.rand(shape, generator=g) < 0.05, 20.0, 1.0)
    x = x.to(dtype)
    valid = torch.rand(shape, generator=g) < 0.7 if masked else None
    e0 = group_sq_err(x, bits, G, axis, clip=False, valid=valid)
    e1 = group_sq_err(x, bits, G, axis, clip=True, valid=valid)
    assert bool((e1 <= e0).all()), (e1 - e0).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_clipping_lowers_the_error_of_gaussian_groups(dtype):
    """It does something: 2-bit groups of 32 Gaussian values are better clipped, most strictly."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    e0 = group_sq_err(x, 2, 32, -1, clip=False)
    e1 = group_sq_err(x, 2, 32, -1, clip=True)
    assert (e1 < e0).float().mean() > 0.5
    assert e1.sum() < 0.85 * e0.sum()


def test_constant_groups_keep_exact_value():
    x = torch.full((2, 3, 26), 1.25)
    x[1, 2, 13:] = -7.0
    codes, scale, offset = quantize_groups(x, 2, 13, -1, clip=True)
    assert torch.equal(scale, torch.zeros_like(scale))
    assert torch.equal(dequantize_groups(codes, scale, offset, 2, 13, -1), x)


def test_min_max_kept_when_it_is_best():
    """Two-valued groups are exact with min/max; clipping must not move them (ties keep min/max)."""
    x = torch.tensor([[0.0, 3.0] * 8])
    ref = quantize_groups(x, 2, 16, -1)
    out = quantize_groups(x, 2, 16, -1, clip=True)
    for a, b in zip(ref, out):
        assert torch.equal(a, b)


def test_padding_does_not_move_the_parameters():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 39, 8, generator=g)  # 39 tokens: three key groups of 13
    valid = torch.ones(1, 39, dtype=torch.bool)
    valid[0, :5] = False
    y = x.clone()
    y[:, :, :5] = 1e4  # wild padding values
    a = quantize_kv(x, "channel", 2, 13, valid=valid, clip=True)
    b = quantize_kv(y, "channel", 2, 13, valid=valid, clip=True)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.offset, b.offset)
    # padded tokens still get finite, in-range codes
    assert torch.isfinite(dequantize_kv(b)).all()


def test_empty_group_is_zero():
    x = torch.randn(16, 2)
    valid = torch.zeros(16, 2, dtype=torch.bool)
    valid[:, 1] = True
    _, scale, offset = quantize_groups(x, 2, 16, 0, valid=valid, clip=True)
    assert scale[0, 0] == 0 and offset[0, 0] == 0


@pytest.mark.parametrize("param_dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_parameters_in_the_stored_dtype(param_dtype):
    x = torch.randn(1, 2, 64, 32)
    p = quantize_kv(x, "channel", 2, 32, param_dtype=param_dtype, clip=True)
    assert p.scale.dtype == param_dtype and p.offset.dtype == param_dtype


def test_clipped_params_picks_from_the_grid():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    lo, hi = x.amin(1), x.amax(1)
    scale, offset = clipped_params(x, lo, hi, 1, 3, torch.float32)
    width = scale * 3
    ratios = width / (hi - lo)
    assert all(min(abs(float(r) - s) for s in SHRINKS) < 1e-5 for r in ratios)


def test_symmetric_refuses_clip():
    with pytest.raises(ValueError, match="clip=True is only implemented for asymmetric"):
        quantize_groups(torch.randn(4, 8), 2, 8, symmetric=True, clip=True)
