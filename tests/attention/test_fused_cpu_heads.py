"""fused_decode_heads (every head group of a per-head-width layer in one numba kernel call) against the plain
path (one run per head group, kivi.attention.interface.head_groups_attention) and the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

from kivi import KiviConfig  # noqa: E402
from kivi.attention.fused_cpu import (  # noqa: E402
    SERIAL_BELOW,
    fused_decode_attention,
    fused_decode_heads,
    fused_decode_heads_supported,
)
from kivi.attention.interface import head_groups_attention  # noqa: E402
from kivi.cache.heads import HeadGroup, HeadSplitLayer  # noqa: E402

CFG = dict(group_size=8, residual_length=16, block_size=32)
WIDTHS = {  # (key widths, value widths, explicit groups or None)
    "k242": ([2, 4, 2], [2, 2, 2], None),
    "k422-v242": ([4, 2, 2], [2, 4, 2], None),
    "k184-v814": ([1, 8, 4], [8, 1, 4], None),
    "uniform-split": ([2, 2, 2], [2, 2, 2], [HeadGroup(0, 1, 2, 2), HeadGroup(1, 3, 2, 2)]),
    "k324-v342": ([3, 2, 4], [3, 4, 2], None),  # 3-bit groups beside 2- and 4-bit ones
    "k3-v3-split": ([3, 3, 3], [3, 3, 3], [HeadGroup(0, 2, 3, 3), HeadGroup(2, 3, 3, 3)]),
}


def _views(widths, B, D, lengths, dtype, *, sink=0, valid=None, seed=0):
    """A HeadSplitLayer (3 kv heads) filled by a prefill and appends of ``lengths``; the last views."""
    kb, vb, groups = WIDTHS[widths]
    layer = HeadSplitLayer(KiviConfig(**CFG, sink_tokens=sink), kb, vb, groups=groups)
    g = torch.Generator().manual_seed(seed)
    views, pos = None, 0
    for T in lengths:
        k = torch.randn(B, 3, T, D, generator=g).to(dtype)
        v = torch.randn(B, 3, T, D, generator=g).to(dtype)
        views = layer.append(k, v, valid=None if valid is None else valid[:, pos : pos + T])
        pos += T
    return views


def _per_group_serial(q, kv, vv, mask=None):
    """The plain path with every group on the calling thread: one fused_decode_attention per group."""
    g = q.shape[1] // kv.groups[-1].stop
    outs = [fused_decode_attention(q[:, grp.start * g : grp.stop * g].contiguous(), k, v, attention_mask=mask,
                                   threaded=False) for grp, k, v in zip(kv.groups, kv.views, vv.views)]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize("total", [1, 13, 67, 301])
@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("sink", [0, 3])
def test_one_call_equals_per_group_bit_for_bit(widths, total, ratio, sink):
    B, D = 2, 32
    lengths = [total] if total < 5 else [total - 3, 1, 1, 1]
    kv, vv = _views(widths, B, D, lengths, torch.float32, sink=sink)
    q = torch.randn(B, 3 * ratio, 1, D)
    assert fused_decode_heads_supported(q, kv, vv)
    out = fused_decode_heads(q, kv, vv, threaded=False)
    assert torch.equal(out, _per_group_serial(q, kv, vv))
    ref = head_groups_attention("reference", q, kv, vv, scaling=None, attention_mask=None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_decode_heads(q, kv, vv, threaded=True), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("widths", ["k242", "k422-v242", "k324-v342"])
def test_dtypes_and_padding(dtype, widths):
    B, D, total = 3, 64, 157
    valid = torch.ones(B, total, dtype=torch.bool)
    valid[1, :9] = False
    valid[2, :70] = False  # left padding across stored blocks
    kv, vv = _views(widths, B, D, [total - 2, 1, 1], dtype, sink=4, valid=valid)
    mask = valid[:, None, None, :]  # [B, 1, 1, T]: the decode row of a padded batch
    q = torch.randn(B, 9, 1, D).to(dtype)
    assert fused_decode_heads_supported(q, kv, vv, mask)
    out = fused_decode_heads(q, kv, vv, attention_mask=mask, threaded=False)
    assert out.dtype == dtype and out.shape == (B, 9, 1, D)
    assert torch.equal(out, _per_group_serial(q, kv, vv, mask))
    ref = head_groups_attention("reference", q, kv, vv, scaling=None, attention_mask=mask)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_threaded_long_context_close_to_per_group():
    """Above SERIAL_BELOW the one call runs split-K on the pool (chunks sized for the whole layer)."""
    B, D, total = 1, 64, SERIAL_BELOW + 517
    kv, vv = _views("k242", B, D, [total - 1, 1], torch.float32)
    q = torch.randn(B, 9, 1, D)
    out = fused_decode_heads(q, kv, vv, threaded=True)
    torch.testing.assert_close(out, _per_group_serial(q, kv, vv), atol=1e-5, rtol=1e-5)


def test_3bit_groups_run_in_the_one_call(monkeypatch):
    """A layer with 3-bit head groups (K3V3 + 4-bit sides, as the ~4.3-bit mixes) decodes in one fused call."""
    import kivi.attention.fused_cpu as pkg
    from kivi.attention.interface import head_groups_attention as run

    kv, vv = _views("k324-v342", 1, 64, [300, 1], torch.float32, sink=4)
    q = torch.randn(1, 9, 1, 64)
    assert fused_decode_heads_supported(q, kv, vv)
    calls, real = [], pkg.fused_decode_heads
    monkeypatch.setattr(pkg, "fused_decode_heads", lambda *a, **k: calls.append(1) or real(*a, **k))
    from kivi.attention.interface import layer_attention

    out = layer_attention("cpu", q, kv, vv, scaling=None, attention_mask=None)
    assert calls == [1]
    torch.testing.assert_close(out, run("reference", q, kv, vv, scaling=None, attention_mask=None), atol=1e-5,
                               rtol=1e-5)


def test_unsupported_group_is_refused_and_errors_are_one_line():
    kv, vv = _views("k242", 1, 32, [40, 1], torch.float32)
    q = torch.randn(1, 6, 1, 30)
    cfg = dict(group_size=6, residual_length=12, block_size=24)  # value groups of 6 channels: not for the kernel
    layer = HeadSplitLayer(KiviConfig(**cfg), [3, 2, 2], [2, 2, 2])
    layer.append(torch.randn(1, 3, 40, 30), torch.randn(1, 3, 40, 30))
    assert not fused_decode_heads_supported(q, *layer.append(torch.randn(1, 3, 1, 30), torch.randn(1, 3, 1, 30)))
    assert not fused_decode_heads_supported(torch.randn(1, 6, 2, 32), kv, vv)  # two queries
    assert not fused_decode_heads_supported(torch.randn(1, 4, 1, 32), kv, vv)  # 4 query heads over 3 kv heads
    with pytest.raises(ValueError, match="one query token"):
        fused_decode_heads(torch.randn(1, 6, 2, 32), kv, vv)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        fused_decode_heads(torch.randn(1, 4, 1, 32), kv, vv)
