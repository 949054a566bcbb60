"""blocked_attention (CPU fast path) against reference_attention on random caches."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.attention import blocked_attention, dense_attention, reference_attention
from kivi.cache.layer import KiviLayer
from kivi.cache.sliding import SlidingKiviLayer


def _fill(cfg, B, hkv, D, lengths, dtype, valid=None, seed=0):
    """Append chunks of ``lengths`` tokens; return the layer and the views of the last append."""
    g = torch.Generator().manual_seed(seed)
    layer = KiviLayer(cfg)
    views = None
    pos = 0
    for T in lengths:
        k = torch.randn(B, hkv, T, D, generator=g).to(dtype)
        v = torch.randn(B, hkv, T, D, generator=g).to(dtype)
        vv = None if valid is None else valid[:, pos : pos + T]
        views = layer.append(k, v, valid=vv)
        pos += T
    return layer, views


def _check(q, views, mask=None, tol=None, **kw):
    ref = reference_attention(q, *views, attention_mask=mask)
    out = blocked_attention(q, *views, attention_mask=mask, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    tol = tol or (2e-2 if q.dtype == torch.bfloat16 else 1e-4)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("total", [1, 13, 67, 300])
@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(total, ratio, dtype):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    B, hkv, D = 2, 2, 32
    lengths = [total - 1, 1] if total > 1 else [1]
    _, views = _fill(cfg, B, hkv, D, lengths, dtype)
    q = torch.randn(B, hkv * ratio, 1, D).to(dtype)
    _check(q, views, block_tokens=16)


@pytest.mark.parametrize("n", [5, 37])
@pytest.mark.parametrize("ratio", [1, 3])
def test_chunk_causal_matches_reference(n, ratio):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    B, hkv, D = 1, 2, 32
    _, views = _fill(cfg, B, hkv, D, [67, 13, n], torch.float32)
    q = torch.randn(B, hkv * ratio, n, D)
    _check(q, views, block_tokens=24, query_chunk=16)  # mask None -> causal (bottom-right)
    # an explicit boolean causal mask gives the same
    T = views[0].split + views[0].fp.shape[-2] - views[0].start
    causal = torch.arange(T)[None, :] <= torch.arange(T - n, T)[:, None]
    _check(q, views, mask=causal[None, None], block_tokens=24, query_chunk=16)


@pytest.mark.parametrize(
    "cfg",
    [
        KiviConfig(group_size=8, residual_length=16, block_size=32, residual_bits=2),  # compensation
        KiviConfig(group_size=8, residual_length=8, block_size=16, k_bits=4, v_bits=4, residual_bits=4),
        KiviConfig(group_size=8, residual_length=16, block_size=32, symmetric=True),
        KiviConfig(group_size=16, residual_length=0, block_size=32, k_bits=3, v_bits=1),
        KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=8, v_bits=8),
        KiviConfig(group_size=8, residual_length=16, block_size=32, quantize_key=False),
        KiviConfig(group_size=8, residual_length=16, block_size=32, quantize_value=False),
    ],
    ids=["comp2", "4bit-comp4", "symmetric", "k3v1-R0", "8bit", "fp-keys", "fp-values"],
)
@pytest.mark.parametrize("n", [1, 9])
def test_formats(cfg, n):
    B, hkv, D = 2, 3, 32
    _, views = _fill(cfg, B, hkv, D, [150, 3, 41, n], torch.float32)
    q = torch.randn(B, hkv * 3, n, D)
    _check(q, views, block_tokens=32, query_chunk=4)


def test_split_k_differs_from_split_v():
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    _, (kv, vv) = _fill(cfg, 1, 1, 16, [45, 1], torch.float32)
    assert kv.split != vv.split
    _check(torch.randn(1, 2, 1, 16), (kv, vv), block_tokens=8)


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("n", [1, 7])
def test_left_padding_mask(float_mask, n):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    B, hkv, D = 3, 2, 32
    prompt = 70
    total = prompt + 4 + n
    valid = torch.ones(B, total, dtype=torch.bool)
    valid[1, :9] = False
    valid[2, :41] = False
    _, views = _fill(cfg, B, hkv, D, [prompt, 4, n], torch.float32, valid=valid)
    q = torch.randn(B, hkv * 3, n, D)
    causal = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    mask = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, n, T]
    if float_mask:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    _check(q, views, mask=mask, block_tokens=16, query_chunk=3)


def test_sliding_window_eviction_and_mask():
    W = 24
    cfg = KiviConfig(group_size=8, residual_length=8, block_size=16)
    layer = SlidingKiviLayer(cfg, sliding_window=W)
    B, hkv, D = 1, 2, 16
    g = torch.Generator().manual_seed(1)
    for _step, n in enumerate([40, 30, 1, 1, 17, 1]):
        kv_len, kv_offset = layer.get_mask_sizes(n)
        k, v = torch.randn(B, hkv, n, D, generator=g), torch.randn(B, hkv, n, D, generator=g)
        views = layer.append(k, v)
        assert views[0].start == kv_offset
        qpos = torch.arange(layer.seen - n, layer.seen)
        kpos = torch.arange(kv_offset, kv_offset + kv_len)
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - W)
        q = torch.randn(B, hkv * 2, n, D, generator=g)
        _check(q, views, mask=mask[None, None], block_tokens=16, query_chunk=8)
    assert layer.kv_offset > 0  # something was evicted


def test_dense_attention_matches_sdpa():
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 2, 20, 16), torch.randn(2, 2, 20, 16)
    mask = torch.rand(2, 1, 5, 20) > 0.3
    mask[..., -1] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask
    )
    torch.testing.assert_close(dense_attention(q, k, v, attention_mask=mask), ref, atol=1e-5, rtol=1e-5)


def test_mismatched_views_raise():
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    _, (kv, _) = _fill(cfg, 1, 1, 16, [20], torch.float32)
    _, (_, vv) = _fill(cfg, 1, 1, 16, [21], torch.float32)
    with pytest.raises(ValueError, match="value view"):
        blocked_attention(torch.randn(1, 1, 1, 16), kv, vv)


@pytest.mark.parametrize("sink", [1, 5])
@pytest.mark.parametrize("n", [1, 9])
def test_sink_tokens_match_reference(sink, n):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, sink_tokens=sink)
    B, hkv, D = 2, 2, 32
    _, views = _fill(cfg, B, hkv, D, [90, 7, n], torch.float32)
    assert views[0].sink is not None and views[0].start == 0
    _check(torch.randn(B, hkv * 3, n, D), views, block_tokens=16, query_chunk=4)
