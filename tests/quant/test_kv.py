import pytest
import torch

from kivi.quant.kv import compensation_values, dequantize_kv, quantize_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4])
def test_shapes_and_bound(dtype, axis, bits):
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 64, 64) * 3).to(dtype)
    q = quantize_kv(x, axis, bits, 32)
    if axis == "channel":
        assert q.scale.shape == (2, 3, 2, 64)
    else:
        assert q.scale.shape == (2, 3, 64, 2)
    assert q.packed.shape == (2, 3, 64, 64 * bits // 8)
    assert q.scale.dtype == dtype
    y = dequantize_kv(q, torch.float32)
    step = q.scale.float().repeat_interleave(32, dim=2 if axis == "channel" else 3)
    tol = 1e-2 if dtype != torch.float32 else 1e-5
    assert torch.all((x.float() - y).abs() <= step / 2 + tol * x.float().abs().amax())


def test_compensation_reduces_group_mean_error():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 256, 64)
    plain = quantize_kv(x, "channel", 2, 32)
    comp = quantize_kv(x, "channel", 2, 32, residual_bits=4)
    err_plain = (x - dequantize_kv(plain)).reshape(1, 2, 8, 32, 64).mean(3).abs().mean()
    err_comp = (x - dequantize_kv(comp)).reshape(1, 2, 8, 32, 64).mean(3).abs().mean()
    assert err_comp < 0.6 * err_plain
    assert comp.comp.shape == (1, 2, 8, 32)  # 64 groups-of-4-bit per row, packed 2 per byte
    assert compensation_values(plain) is None


@pytest.mark.parametrize("rb", [1, 2, 4])
def test_compensation_of_exact_groups_is_exactly_zero(rb):
    """Groups quantized without error (two distinct values at 2 bits) get no correction, whatever the noise."""
    lo_hi = torch.tensor([-1.0, 2.0]).repeat(16)  # 32 tokens, min/max exactly representable
    x = lo_hi[None, None, :, None].expand(1, 1, 32, 64).clone()
    for eps in (0.0, 1e-7, -1e-7):
        q = quantize_kv(x + eps, "channel", 2, 32, residual_bits=rb)
        assert torch.equal(compensation_values(q), torch.zeros_like(q.scale.float()))
        torch.testing.assert_close(dequantize_kv(q), x + eps)


def test_valid_mask_only_affects_statistics_of_keys():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 32, 64)
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[1, :7] = False
    a = x.clone()
    a[1, :, :7] = 100.0
    qa = quantize_kv(a, "channel", 2, 32, valid=valid)
    qx = quantize_kv(x, "channel", 2, 32, valid=valid)
    assert torch.equal(qa.scale, qx.scale) and torch.equal(qa.offset, qx.offset)
    ya, yx = dequantize_kv(qa), dequantize_kv(qx)
    assert torch.equal(ya[1, :, 7:], yx[1, :, 7:])


def test_bad_input():
    with pytest.raises(ValueError, match="batch, heads, tokens, head_dim"):
        quantize_kv(torch.randn(4, 64), "token", 2, 32)
    with pytest.raises(ValueError, match="axis="):
        quantize_kv(torch.randn(1, 1, 32, 64), "rows", 2, 32)


def test_a_segment_carries_the_format_it_was_quantized_in():
    """``PackedKV.format`` is the side format itself (``quantize_side``) or the one its arguments name
    (``quantize_kv``); ``bits`` / ``group_size`` / ``axis`` / ``residual_bits`` read it, and demotion changes its
    width only."""
    import dataclasses

    from kivi.quant.demote import demote_kv
    from kivi.quant.kv import quantize_side
    from kivi.quant.side_format import SideFormat

    x = torch.randn(1, 2, 16, 8)
    fmt = SideFormat("token", 4, 4, clip=True)
    seg = quantize_side(x, fmt)
    assert seg.format is fmt and (seg.bits, seg.group_size, seg.axis, seg.residual_bits) == (4, 4, "token", 0)
    keys = quantize_kv(x, "channel", 2, 8, residual_bits=2, param_dtype=torch.float32)
    assert keys.format == SideFormat("channel", 2, 8, residual_bits=2, scale_dtype=torch.float32)
    assert demote_kv(seg, 2).format == dataclasses.replace(fmt, bits=2)
