"""Triton decode attention over the packed cache vs the torch reference (TRITON_INTERPRET=1, CPU)."""

from __future__ import annotations

import pytest
import torch

from kivi.kernels import decode_attention_packed, torch_decode_attention_packed
from kivi.quant.kv import dequantize_kv, quantize_kv

pytestmark = pytest.mark.triton

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(B, Hq, Hkv, D, T, Tqk, Tqv, dtype, k_bits=2, v_bits=2, G=32, Gv=None, seed=0):
    """q, PackedKV keys over [0, Tqk), fp key tail, PackedKV values over [0, Tqv), fp value tail."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, Hkv, T, D, generator=g) * 1.5).to(dtype)
    k[..., 1] += 4.0  # an outlier channel, as in real keys
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    pk = quantize_kv(k[:, :, :Tqk], "channel", k_bits, G) if Tqk else None
    pv = quantize_kv(v[:, :, :Tqv], "token", v_bits, Gv or G) if Tqv else None
    return q, pk, k[:, :, Tqk:], pv, v[:, :, Tqv:]


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
def test_matches_reference(dtype, hq, hkv):
    # T = 67: keys 64 quantized + 3 fp, values 61 quantized + 6 fp (Tq_k != Tq_v)
    q, pk, kf, pv, vf = _case(2, hq, hkv, 64, 67, 64, 61, dtype, seed=hq)
    out = decode_attention_packed(q, pk, kf, pv, vf, scaling=64**-0.5, block_n=16)
    ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=64**-0.5)
    _check(out, ref, dtype)


def test_four_bits_mask_and_per_side_group_sizes():
    """Widths and group sizes differ per side and are read off each segment's format, whatever the knobs."""
    dtype = torch.float16
    q, pk, kf, pv, vf = _case(2, 6, 2, 32, 77, 64, 67, dtype, k_bits=4, v_bits=4, G=32, Gv=16, seed=7)
    assert (pk.format.group_size, pv.format.group_size) == (32, 16)
    valid = torch.ones(2, 77, dtype=torch.bool)
    valid[0, :9] = False  # left padding
    valid[1, 30:40] = False
    ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=0.2, kv_valid=valid)
    for splits, block_n in ((2, 16), (1, 32)):
        _check(decode_attention_packed(q, pk, kf, pv, vf, scaling=0.2, kv_valid=valid, num_splits=splits,
                                       block_n=block_n), ref, dtype)


# 3-bit codes: runs of 8 codes in 3 bytes, a code may straddle two bytes. D = 20: the last run holds
# 4 codes (9 bytes a row); T = 67 / 77 odd, key groups not filling T, values cut mid-group.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,Gv", [(64, 32), (20, 10)])
@pytest.mark.parametrize("kb,vb", [(3, 3), (3, 2), (4, 3)], ids=["k3v3", "k3v2", "k4v3"])
def test_three_bit_codes_match_reference(dtype, D, Gv, kb, vb):
    q, pk, kf, pv, vf = _case(2, 6, 2, D, 77, 64, 67, dtype, k_bits=kb, v_bits=vb, G=16, Gv=Gv, seed=D + kb)
    assert pk.packed.shape[-1] == (-(-D // 8) * 3 if kb == 3 else D * kb // 8)
    valid = torch.ones(2, 77, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    out = decode_attention_packed(q, pk, kf, pv, vf, scaling=D**-0.5, kv_valid=valid, block_n=16, num_splits=2)
    ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=D**-0.5, kv_valid=valid)
    _check(out, ref, dtype)


def test_a_segment_whose_codes_do_not_fit_its_format_is_refused():
    """The format travels with the data; codes of another width than the format says are refused by name."""
    import dataclasses

    q, pk, kf, pv, vf = _case(1, 4, 2, 40, 45, 32, 43, torch.float32, k_bits=3, v_bits=3, G=16, Gv=8, seed=11)
    _check(decode_attention_packed(q, pk, kf, pv, vf, scaling=0.2, block_n=16),
           torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=0.2), torch.float32)
    wrong = dataclasses.replace(pk, format=dataclasses.replace(pk.format, bits=4))  # 15 bytes for 40 channels
    for attend in (decode_attention_packed, torch_decode_attention_packed):
        with pytest.raises(ValueError, match="k.packed has 15 bytes per token, expected 20 for bits=4"):
            attend(q, wrong, kf, pv, vf, scaling=0.2)


def test_reference_equals_dense_sdpa():
    q, pk, kf, pv, vf = _case(1, 6, 2, 32, 45, 32, 40, torch.float32, seed=3)
    k = torch.cat([dequantize_kv(pk), kf], dim=-2)
    v = torch.cat([dequantize_kv(pv), vf], dim=-2)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=0.3)
    torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["fp_only", "quantized_only", "values_fp_only"])
def test_segment_layouts(layout):
    dtype = torch.float32
    if layout == "fp_only":  # nothing quantized yet (short prompt)
        q, pk, kf, pv, vf = _case(1, 3, 1, 32, 13, 0, 0, dtype)
    elif layout == "quantized_only":  # no tail on either side
        q, pk, kf, pv, vf = _case(1, 3, 1, 32, 64, 64, 64, dtype)
        kf, vf = None, None
    else:  # keys quantized, values all full precision (quantize_value=False)
        q, pk, kf, pv, vf = _case(1, 3, 1, 32, 35, 32, 0, dtype)
    out = decode_attention_packed(q, pk, kf, pv, vf, scaling=0.25, block_n=16)
    ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=0.25)
    _check(out, ref, dtype)


def test_constant_groups_and_fully_masked_row():
    B, Hkv, D, T = 2, 1, 32, 40
    k = torch.full((B, Hkv, T, D), 0.5)
    v = torch.full((B, Hkv, T, D), -1.25)
    q = torch.randn(B, 2, 1, D)
    pk = quantize_kv(k[:, :, :32], "channel", 2, 32)
    pv = quantize_kv(v[:, :, :32], "token", 2, 32)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1] = False  # batch row 1 attends to nothing -> zeros
    out = decode_attention_packed(q, pk, k[:, :, 32:], pv, v[:, :, 32:], scaling=0.2, kv_valid=valid, block_n=16)
    ref = torch_decode_attention_packed(q, pk, k[:, :, 32:], pv, v[:, :, 32:], scaling=0.2, kv_valid=valid)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[0], torch.full_like(out[0], -1.25), rtol=0, atol=1e-6)


def test_strided_views_are_accepted():
    """The cache may hand over views of larger preallocated blocks (last axis contiguous)."""
    q, pk, kf, pv, vf = _case(1, 4, 2, 32, 40, 32, 33, torch.float32, seed=9)
    big = torch.zeros(1, 2, 48, 32)
    big[:, :, :8] = kf
    kf_view = big[:, :, :8]
    out = decode_attention_packed(q, pk, kf_view, pv, vf, scaling=0.2, block_n=16)
    ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=0.2)
    _check(out, ref, torch.float32)


def test_rejects_bad_inputs():
    q, pk, kf, pv, vf = _case(1, 4, 2, 32, 40, 32, 33, torch.float32)
    with pytest.raises(ValueError, match="same tokens"):
        decode_attention_packed(q, pk, kf, pv, vf[:, :, 1:], scaling=0.2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention_packed(q[:, :3], pk, kf, pv, vf, scaling=0.2)
    with pytest.raises(ValueError, match=r"\[B, Hq, 1, D\]"):
        decode_attention_packed(torch.cat([q, q], dim=2), pk, kf, pv, vf, scaling=0.2)
    comp = quantize_kv(torch.randn(1, 2, 32, 32), "channel", 2, 32, residual_bits=2)
    with pytest.raises(NotImplementedError, match="compensation"):
        decode_attention_packed(q, comp, kf, pv, vf, scaling=0.2)
