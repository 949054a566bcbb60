"""The Triton decode kernel over multi-segment sides (sink + several stored blocks + tail) vs the torch
reference, under TRITON_INTERPRET=1 on CPU. Small shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from kivi.kernels.segments import build_block_table, kernel_side
from kivi.kernels.triton_attention import decode_attention_sides, torch_decode_attention_sides
from kivi.quant.kv import dequantize_kv, quantize_kv

pytestmark = pytest.mark.triton

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
NAN = float("nan")


def _blocks(x, axis, bits, G, firsts, caps, split, origin=0):
    """Whole blocks of ``x`` (absolute positions), as a store holds them: block i holds tokens
    ``[firsts[i], firsts[i] + caps[i])``; rows at or past ``split`` are garbage (NaN parameters,
    random codes), so a kernel that read them would return NaN."""
    out = []
    need = max(f - origin + cap for f, cap in zip(firsts, caps)) - x.shape[-2]
    if need > 0:  # the last block's unfilled rows: whatever the allocation held
        x = torch.cat([x, torch.randn(*x.shape[:2], need, x.shape[-1]).to(x.dtype)], dim=-2)
    for f, cap in zip(firsts, caps):
        seg = quantize_kv(x[:, :, f - origin : f - origin + cap], axis, bits, G)
        filled = max(0, split - f)
        if filled < cap:
            d = G if axis == "channel" else 1
            seg.scale[:, :, filled // d :] = NAN
            seg.offset[:, :, filled // d :] = NAN
        out.append((f, seg))
    return out


def _side(x, axis, bits, G, S, firsts, caps, split, device="cpu", origin=0):
    """KernelSide over ``x [B, H, T, D]``: sink ``[0, S)``, blocks, tail ``[split, T)`` (positions relative)."""
    table = (build_block_table(_blocks(x, axis, bits, G, firsts, caps, split + origin, origin), axis, device)
             if firsts else None)
    sink = x[:, :, :S] if S else None
    fp = x[:, :, split:] if split < x.shape[-2] else None
    return kernel_side(sink, table, split, fp, origin=origin)


def _dense(x, axis, bits, G, S, firsts, caps, split, origin=0):
    """What the side means: sink exact, stored tokens quantized-dequantized, tail exact (float32)."""
    parts = [x[:, :, :S].float()]
    for f, seg in _blocks(x, axis, bits, G, firsts, caps, split + origin, origin):
        lo, hi = max(f - origin, S), min(f - origin + seg.num_tokens, split)
        parts.append(dequantize_kv(seg)[:, :, lo - (f - origin) : hi - (f - origin)])
    parts.append(x[:, :, split:].float())
    return torch.cat(parts, dim=-2)


def _case(B, Hq, Hkv, D, T, dtype, *, S, kb, vb, G, key_blocks, val_blocks, seed=0):
    """q, keys / values [B, Hkv, T, D] and their sides; blocks = (firsts, caps, split)."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, Hkv, T, D, generator=g) * 1.5).to(dtype)
    k[..., 1] += 4.0  # an outlier channel, as in real keys
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    ks = _side(k, "channel", kb, G, S, *key_blocks)
    vs = _side(v, "token", vb, G, S, *val_blocks)
    return q, k, v, ks, vs


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


def _dense_attention(q, k, v, scaling, valid=None):
    rep = q.shape[1] // k.shape[1]
    s = q.float() @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scaling
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return (torch.softmax(s, -1) @ v.repeat_interleave(rep, 1)).to(q.dtype)


# A cache-like layout, T = 4 sink + 96 prefill block + 64-token blocks, keys split on a group boundary
# (G = 16), values one token further; the last block of each side is only partly filled.
S4 = dict(S=4, G=16, key_blocks=([4, 100, 164], [96, 64, 64], 180), val_blocks=([4, 100, 164], [96, 64, 64], 195))
S0 = dict(S=0, G=16, key_blocks=([0, 96, 160], [96, 64, 64], 176), val_blocks=([0, 96, 160], [96, 64, 64], 190))


@pytest.mark.parametrize(
    "layout,dtype",
    [(S4, torch.float32), (S4, torch.float16), (S4, torch.bfloat16), (S0, torch.float32)],
    ids=["sink4-fp32", "sink4-fp16", "sink4-bf16", "sink0-fp32"],
)
def test_sink_and_several_blocks_match_reference(dtype, layout):
    # T = 203: odd, not a multiple of the group size; GQA 6 query heads over 2 kv heads
    q, k, v, ks, vs = _case(2, 6, 2, 32, 203, dtype, kb=4, vb=2, **layout, seed=1)
    assert ks.n_blocks == 3 and vs.n_blocks == 3
    out = decode_attention_sides(q, ks, vs, scaling=32**-0.5, block_n=32, num_splits=3)
    ref = torch_decode_attention_sides(q, ks, vs, scaling=32**-0.5)
    _check(out, ref, dtype)
    # the sides' reference is the dense meaning of the pieces (sink exact, blocks dequantized, tail exact)
    G, S = layout["G"], layout["S"]
    kd = _dense(k, "channel", 4, G, S, *layout["key_blocks"])
    vd = _dense(v, "token", 2, G, S, *layout["val_blocks"])
    torch.testing.assert_close(ref, _dense_attention(q, kd, vd, 32**-0.5), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("kb,vb", [(2, 2), (4, 8), (8, 4), (1, 2)], ids=["k2v2", "k4v8", "k8v4", "k1v2"])
def test_word_bit_widths(kb, vb):
    q, _, _, ks, vs = _case(1, 4, 1, 32, 203, torch.float32, kb=kb, vb=vb, **S4, seed=kb * 10 + vb)
    out = decode_attention_sides(q, ks, vs, scaling=0.2, block_n=32, num_splits=2)
    _check(out, torch_decode_attention_sides(q, ks, vs, scaling=0.2), torch.float32)


@pytest.mark.parametrize(
    "kb,vb,dtype",
    [(3, 3, torch.float32), (3, 3, torch.bfloat16), (3, 2, torch.float16), (8, 3, torch.float32)],
    ids=["k3v3-fp32", "k3v3-bf16", "k3v2-fp16", "k8v3-fp32"],
)
def test_three_bit_blocks_with_sinks_and_window(kb, vb, dtype):
    """3-bit codes (a code may straddle two bytes) read from a sink, three stored blocks (the last partly
    filled, its garbage rows NaN) and the window; T = 203, GQA 3; each side's rows ceil(D / 8) * 3 bytes."""
    q, k, v, ks, vs = _case(2, 6, 2, 32, 203, dtype, kb=kb, vb=vb, **S4, seed=30 + kb + vb)
    assert (
        ks.blocks.bits == kb and vs.blocks.bits == vb and vs.blocks.data_row_stride == (12 if vb == 3 else 32 * vb // 8)
    )
    valid = torch.ones(2, 203, dtype=torch.bool)
    valid[0, :11] = False
    out = decode_attention_sides(q, ks, vs, scaling=32**-0.5, kv_valid=valid, block_n=32, num_splits=3)
    _check(out, torch_decode_attention_sides(q, ks, vs, scaling=32**-0.5, kv_valid=valid), dtype)


def test_three_bit_odd_head_dim_and_small_blocks():
    """head_dim 20 (BLOCK_D 32, a last run of 4 codes: 9 bytes a row), many 8-token blocks in one tile."""
    lay = dict(S=4, G=8, key_blocks=([4, 28, 36, 44, 52], [24, 8, 8, 8, 8], 56),
               val_blocks=([4, 28, 36, 44, 52], [24, 8, 8, 8, 8], 59))
    q, _, _, ks, vs = _case(1, 2, 1, 20, 61, torch.float32, kb=3, vb=3, **{**lay, "G": 4}, seed=8)
    assert ks.blocks.data_row_stride == 9
    for block_n, splits in ((64, 1), (16, 2)):
        out = decode_attention_sides(q, ks, vs, scaling=0.3, block_n=block_n, num_splits=splits)
        _check(out, torch_decode_attention_sides(q, ks, vs, scaling=0.3), torch.float32)


def test_padding_mask_and_fully_masked_row():
    q, _, _, ks, vs = _case(3, 3, 1, 32, 203, torch.float16, kb=2, vb=2, **S4, seed=5)
    valid = torch.ones(3, 203, dtype=torch.bool)
    valid[0, :13] = False  # left padding reaching past the sink
    valid[1, 90:130] = False  # a hole across a block boundary
    valid[2] = False  # attends to nothing -> zeros
    out = decode_attention_sides(q, ks, vs, scaling=0.2, kv_valid=valid, block_n=16, num_splits=4)
    ref = torch_decode_attention_sides(q, ks, vs, scaling=0.2, kv_valid=valid)
    _check(out, ref, torch.float16)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_tiles_smaller_than_blocks_and_blocks_smaller_than_tiles():
    """Many small blocks inside one tile (the cursor advances several times per tile) and one tile
    spanning sink, blocks and tail; odd head_dim 24 (BLOCK_D 32)."""
    lay = dict(S=4, G=8, key_blocks=([4, 28, 36, 44, 52], [24, 8, 8, 8, 8], 56),
               val_blocks=([4, 28, 36, 44, 52], [24, 8, 8, 8, 8], 59))
    q, _, _, ks, vs = _case(1, 2, 2, 24, 61, torch.float32, kb=2, vb=4, **lay, seed=3)
    for block_n, splits in ((64, 1), (16, 2)):
        out = decode_attention_sides(q, ks, vs, scaling=0.3, block_n=block_n, num_splits=splits)
        _check(out, torch_decode_attention_sides(q, ks, vs, scaling=0.3), torch.float32)


def test_evicted_front_and_origin():
    """A sliding layer's view starts at ``origin`` > 0 inside the first block (tokens before it are
    evicted: their rows are NaN here); positions are relative to the origin."""
    g = torch.Generator().manual_seed(4)
    B, H, D, origin, T = 1, 2, 32, 40, 70  # absolute tokens [40, 110)
    k_all = torch.randn(B, H, origin + T, D, generator=g)
    v_all = torch.randn(B, H, origin + T, D, generator=g)
    q = torch.randn(B, 4, 1, D, generator=g)

    def side(x, axis, split_abs):
        blocks = _blocks(x, axis, 2, 16, [0, 64], [64, 64], split_abs)
        for _, seg in blocks[:1]:  # the evicted rows of the first block: garbage
            d = 16 if axis == "channel" else 1
            seg.scale[:, :, : origin // d] = NAN
        table = build_block_table(blocks, axis, "cpu")
        return kernel_side(None, table, split_abs - origin, x[:, :, split_abs:], origin=origin)

    ks, vs = side(k_all, "channel", 96), side(v_all, "token", 100)
    out = decode_attention_sides(q, ks, vs, scaling=0.2, block_n=16)
    ref = torch_decode_attention_sides(q, ks, vs, scaling=0.2)
    _check(out, ref, torch.float32)
    assert ref.shape == (1, 4, 1, D) and ks.num_tokens == T


def test_full_precision_blocks():
    """A side stored unquantized (quantize_value=False): its blocks are plain tensors."""
    g = torch.Generator().manual_seed(6)
    v = torch.randn(1, 2, 50, 32, generator=g)
    k = torch.randn(1, 2, 50, 32, generator=g)
    q = torch.randn(1, 2, 1, 32, generator=g)
    ks = _side(k, "channel", 2, 16, 0, [0, 32], [32, 32], 48)
    vblocks = [(0, v[:, :, :20].clone()), (20, torch.cat([v[:, :, 20:50], torch.full((1, 2, 10, 32), NAN)], 2))]
    vs = kernel_side(None, build_block_table(vblocks, "token", "cpu"), 50, None)
    out = decode_attention_sides(q, ks, vs, scaling=0.2, block_n=16)
    _check(out, torch_decode_attention_sides(q, ks, vs, scaling=0.2), torch.float32)


def test_sides_are_checked():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 64, 32, generator=g)
    blocks = _blocks(x, "channel", 2, 16, [0, 32], [32, 32], 64)
    table = build_block_table(blocks, "channel", "cpu")
    gap = build_block_table([blocks[0], (48, quantize_kv(x[:, :, 48:], "channel", 2, 16))], "channel", "cpu")
    with pytest.raises(ValueError, match="uncovered"):
        kernel_side(None, gap, 64, None)
    with pytest.raises(ValueError, match="cover"):
        kernel_side(None, table, 80, None)  # the blocks end at 64
    with pytest.raises(ValueError, match="overlap"):
        build_block_table([blocks[0], (16, blocks[1][1])], "channel", "cpu")
    with pytest.raises(ValueError, match="increase"):
        build_block_table([blocks[1], blocks[0]], "channel", "cpu")
    with pytest.raises(ValueError, match="axis"):
        build_block_table(blocks, "token", "cpu")
    sym = quantize_kv(x[:, :, :32], "channel", 2, 16, symmetric=True)
    with pytest.raises(NotImplementedError, match="symmetric"):
        build_block_table([(0, sym)], "channel", "cpu")
    comp = quantize_kv(x[:, :, :32], "channel", 2, 16, residual_bits=2)
    with pytest.raises(NotImplementedError, match="compensation"):
        build_block_table([(0, comp)], "channel", "cpu")
    with pytest.raises(ValueError, match="share"):
        build_block_table([blocks[0], (32, quantize_kv(x[:, :, 32:], "channel", 4, 16))], "channel", "cpu")
    with pytest.raises(ValueError, match="split"):
        kernel_side(x[:, :, :8], None, 4, x[:, :, 4:])
    ks = kernel_side(None, table, 64, None)
    vs = kernel_side(None, None, 0, x[:, :, :63])
    with pytest.raises(ValueError, match="same tokens"):
        decode_attention_sides(torch.randn(1, 2, 1, 32), ks, vs, scaling=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kb", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("vb", [2, 3, 4, 8])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (9, 3), (8, 1)], ids=["mha", "gqa3", "gqa8"])
def test_matrix(dtype, kb, vb, hq, hkv):
    """Every width (3 bits included) on both sides x dtypes x GQA ratios, with sinks, three blocks, a mask."""
    q, _, _, ks, vs = _case(2, hq, hkv, 64, 203, dtype, kb=kb, vb=vb, **S4, seed=kb + 7 * vb + hq)
    valid = torch.ones(2, 203, dtype=torch.bool)
    valid[1, :21] = False
    out = decode_attention_sides(q, ks, vs, scaling=0.125, kv_valid=valid, block_n=32)
    _check(out, torch_decode_attention_sides(q, ks, vs, scaling=0.125, kv_valid=valid), dtype)
