"""quantize_tokens_into / quantize_tokens (numba, per-token values) against quantize_kv(axis="token") / quantize_side:
bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from kivi.quant.kv import dequantize_kv, quantize_kv, quantize_side  # noqa: E402
from kivi.quant.numba_quant import (  # noqa: E402
    quantize_tokens,
    quantize_tokens_into,
    token_quantizer_supported,
    tokens_quantizable,
)
from kivi.quant.packing import packed_size  # noqa: E402
from kivi.quant.side_format import SideFormat  # noqa: E402


def _fmt(bits, G, clip=False):
    return SideFormat("token", bits, G, clip=clip)


def _outputs(B, H, n, D, bits, G):
    return (torch.empty(B, H, n, packed_size(D, bits), dtype=torch.uint8), torch.empty(B, H, n, D // G),
            torch.empty(B, H, n, D // G))


def _assert_same(x, bits, G, clip=False):
    ref = quantize_kv(x, "token", bits, G, clip=clip)
    pk, sc, of = _outputs(*x.shape, bits, G)
    quantize_tokens_into(x, _fmt(bits, G, clip), pk, sc, of)
    assert torch.equal(pk, ref.packed)
    assert torch.equal(sc, ref.scale)
    assert torch.equal(of, ref.offset)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    G=st.sampled_from([4, 8, 12, 32]),
    groups=st.integers(1, 4),
    n=st.integers(1, 5),
    scale=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
    clip=st.booleans(),
)
def test_random_rows_match_reference(bits, G, groups, n, scale, seed, clip):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, n, G * groups, generator=g) * scale
    _assert_same(x, bits, G, clip)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    G=st.sampled_from([3, 4, 13, 32]),
    n=st.integers(1, 6),
    heavy=st.sampled_from([1.0, 8.0, 1e3]),
    grid=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_clipped_rows_match_reference_bit_for_bit(bits, G, n, heavy, grid, seed):
    """Clipping's choice (7 candidates, float32 error sums) is made identically by both paths, also
    on heavy-tailed rows and on coarse value grids where candidates tie."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, n, G * 2, generator=g)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.1, heavy, 1.0)
    if grid:
        x = torch.round(x * 2) / 2
    _assert_same(x, bits, G, clip=True)
    if bits == 2 and G >= 13:  # and it changed something (the test would pass vacuously otherwise)
        assert not torch.equal(quantize_kv(x, "token", 2, G, clip=True).scale, quantize_kv(x, "token", 2, G).scale)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_ties_round_half_to_even_like_torch(bits):
    """Values on a half-step grid: (x - lo) / scale lands exactly on .5 for many elements."""
    g = torch.Generator().manual_seed(1)
    levels = 2**bits - 1
    x = torch.randint(0, 2 * levels + 1, (2, 2, 7, 32), generator=g).float() * 0.25
    x[..., 0] = 0.0
    x[..., 31] = 0.5 * levels  # every 32-wide row spans [0, levels/2]: scale 0.5, codes hit .5 ties
    _assert_same(x, bits, 32)


def test_constant_groups_and_odd_head_dim():
    x = torch.randn(1, 2, 3, 12)
    x[:, :, :, :4] = 0.75  # one constant group per row: scale 0, codes 0, dequantizes exactly
    for bits in (1, 2, 3, 4, 8):
        _assert_same(x, bits, 4, clip=True)
        _assert_same(x, bits, 4)  # 12 channels at 1 bit: 2 bytes, the last half-empty; at 3 bits: 2 runs
    pk, sc, of = _outputs(1, 2, 3, 12, 2, 4)
    quantize_tokens_into(x, _fmt(2, 4), pk, sc, of)
    assert torch.all(sc[..., 0] == 0)
    ref = quantize_kv(x, "token", 2, 4)
    assert torch.equal(dequantize_kv(ref)[..., :4], x[..., :4])


@pytest.mark.parametrize("bits", [2, 3])
def test_writes_into_strided_views(bits):
    """The store hands out row ranges of bigger blocks: non-contiguous views."""
    x = torch.randn(2, 3, 4, 64)
    pk = torch.full((2, 3, 10, packed_size(64, bits)), 0xAB, dtype=torch.uint8)
    sc, of = torch.full((2, 3, 10, 2), 7.0), torch.full((2, 3, 10, 2), 7.0)
    quantize_tokens_into(x, _fmt(bits, 32), pk[:, :, 3:7], sc[:, :, 3:7], of[:, :, 3:7])
    ref = quantize_kv(x, "token", bits, 32)
    assert torch.equal(pk[:, :, 3:7], ref.packed) and torch.equal(sc[:, :, 3:7], ref.scale)
    assert torch.equal(of[:, :, 3:7], ref.offset)
    assert torch.all(pk[:, :, :3] == 0xAB) and torch.all(pk[:, :, 7:] == 0xAB)  # nothing else touched
    assert torch.all(sc[:, :, :3] == 7.0) and torch.all(of[:, :, 7:] == 7.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad):
    x = torch.randn(1, 1, 2, 32)
    x[0, 0, 1, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_tokens_into(x, _fmt(2, 32), *_outputs(1, 1, 2, 32, 2, 32))


def test_bad_arguments_raise():
    x = torch.randn(1, 1, 2, 32)
    with pytest.raises(ValueError, match="float32"):
        quantize_tokens_into(x.bfloat16(), _fmt(2, 32), *_outputs(1, 1, 2, 32, 2, 32))
    with pytest.raises(ValueError, match="bits=5"):
        quantize_tokens_into(x, _fmt(5, 32), *_outputs(1, 1, 2, 32, 2, 32))
    with pytest.raises(ValueError, match="group_size=12"):
        quantize_tokens_into(x, _fmt(2, 12), *_outputs(1, 1, 2, 32, 2, 32))
    with pytest.raises(ValueError, match="do not match"):
        quantize_tokens_into(x, _fmt(2, 32), *_outputs(1, 1, 3, 32, 2, 32))


def test_supported_only_where_it_is_exact():
    ok = SideFormat("token", 2, 32)
    assert token_quantizer_supported(ok, torch.float32)
    assert not token_quantizer_supported(ok, torch.bfloat16)
    assert token_quantizer_supported(replace(ok, bits=3), torch.float32)  # runs of 8 codes in 3 bytes
    assert token_quantizer_supported(replace(ok, clip=True), torch.float32)
    assert not token_quantizer_supported(replace(ok, axis="channel"), torch.float32)  # keys: groups over tokens
    assert not token_quantizer_supported(replace(ok, symmetric=True), torch.float32)
    assert not token_quantizer_supported(replace(ok, residual_bits=2), torch.float32)
    assert not token_quantizer_supported(replace(ok, scale_dtype=torch.float16), torch.float32)
    assert token_quantizer_supported(replace(ok, scale_dtype=torch.float32), torch.float32)
    assert not token_quantizer_supported(replace(ok, check_finite=False), torch.float32)


# ------------------------------------------------------------------------ quantize_tokens (any supported dtype)
def _assert_side_same(x, fmt):
    ref, got = quantize_side(x, fmt), quantize_tokens(x, fmt)
    for name in ("packed", "scale", "offset"):
        a, b = getattr(ref, name), getattr(got, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert got.comp is None and (got.bits, got.group_size, got.axis, got.head_dim) == (fmt.bits, fmt.group_size,
                                                                                        fmt.axis, x.shape[-1])
    return got


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale_dtype=st.sampled_from([None, torch.float32, torch.bfloat16]),
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    G=st.sampled_from([3, 4, 13, 32]),
    groups=st.integers(1, 3),
    n=st.integers(1, 6),
    mag=st.sampled_from([1e-4, 1.0, 300.0]),
    clip=st.booleans(),
    constant=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantize_tokens_matches_quantize_side(dtype, scale_dtype, bits, G, groups, n, mag, clip, constant, seed):
    """Every input dtype and parameter dtype it accepts, bfloat16 parameters rounded (ties to even) before the
    codes are computed against them, clipping included, and all-constant groups."""
    fmt = SideFormat("token", bits, G, clip=clip, scale_dtype=scale_dtype)
    if fmt.param_dtype(dtype) == torch.float16:
        assert not tokens_quantizable(fmt, dtype)
        return
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, n, G * groups, generator=g) * mag).to(dtype)
    if constant:
        x[:, :, :, :G] = 0.75
    got = _assert_side_same(x, fmt)
    if constant:
        assert torch.all(got.scale[..., 0] == 0)


def test_quantize_tokens_bfloat16_params_round_before_the_codes():
    """The rounding of a bfloat16 scale changes codes (so the test would fail if the parameters were rounded only
    when stored): some rows whose codes differ from those computed against the float32 parameters."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 64, 32, generator=g)
    fmt = SideFormat("token", 2, 32, scale_dtype=torch.bfloat16)
    got = _assert_side_same(x, fmt)
    assert not torch.equal(got.packed, quantize_side(x, SideFormat("token", 2, 32)).packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_tokens_refuses_non_finite_and_what_it_cannot_reproduce(dtype):
    x = torch.randn(1, 2, 3, 32).to(dtype)
    x[0, 1, 2, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_tokens(x, SideFormat("token", 2, 32))
    for fmt in (SideFormat("channel", 2, 32), SideFormat("token", 2, 32, symmetric=True),
                SideFormat("token", 2, 32, residual_bits=2), SideFormat("token", 2, 32, scale_dtype=torch.float16)):
        assert not tokens_quantizable(fmt, dtype)
        with pytest.raises(ValueError, match="tokens_quantizable"):
            quantize_tokens(x, fmt)
    with pytest.raises(ValueError, match="group_size=12"):
        quantize_tokens(torch.randn(1, 1, 2, 32), SideFormat("token", 2, 12))
    with pytest.raises(ValueError, match="batch, heads, tokens, head_dim"):
        quantize_tokens(torch.randn(2, 32), SideFormat("token", 2, 32))
    assert not tokens_quantizable(SideFormat("token", 2, 32), torch.float16)  # float16 parameters: the torch path
    assert tokens_quantizable(SideFormat("token", 2, 32, scale_dtype=torch.float32), torch.float16)


def test_quantize_tokens_into_writes_nothing_when_a_later_row_is_not_finite():
    """Every row is checked before any is written (the first rows used to be written before the NaN was met)."""
    x = torch.randn(1, 2, 3, 32)
    x[0, 1, 2, 0] = float("inf")
    pk, sc, of = (torch.full_like(t, 7) for t in _outputs(1, 2, 3, 32, 2, 32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_tokens_into(x, _fmt(2, 32), pk, sc, of)
    assert torch.all(pk == 7) and torch.all(sc == 7) and torch.all(of == 7)
