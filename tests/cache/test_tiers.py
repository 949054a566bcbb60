"""Position tiers (KiviConfig.tiers): where tokens are, demotion in the layer, every backend, crop,
rollback, batch edits, refusals, and the planner byte for byte (docs/python.md, "Position tiers")."""

from __future__ import annotations

import copy

import pytest
import torch

from kivi import KiviConfig
from kivi.attention import blocked_attention, reference_attention
from kivi.attention.fused_cpu import fused_decode_attention, fused_decode_supported
from kivi.attention.interface import run_backend
from kivi.cache.layer import KiviLayer
from kivi.cache.schedule import side_tokens, tier_keeps, tier_tokens
from kivi.cache.sliding import SlidingKiviLayer
from kivi.cache.store import BlockStore
from kivi.cache.view import materialize
from kivi.memory.storage import layer_bytes
from kivi.optional import numba_available
from kivi.quant.demote import demote_kv
from kivi.quant.kv import dequantize_kv, quantize_kv

T3 = dict(k_bits=4, v_bits=4, group_size=16, residual_length=32, block_size=64,
          tiers=[(32, None), (48, 4), (None, 2)])
# four tiers, per-side widths (K8 V4 -> K4 V2 -> K2 V1), sinks
T4 = dict(k_bits=8, v_bits=4, group_size=16, residual_length=16, block_size=32, sink_tokens=3,
          tiers=[(16, None), (32, (8, 4)), (64, (4, 2)), (None, (2, 1))])
# K4V2 then K2V2 (values keep their width: a plain move between stores)
TKV = dict(k_bits=4, v_bits=2, group_size=32, residual_length=64, block_size=64, sink_tokens=4,
           tiers=[(64, None), (64, (4, 2)), (None, 2)])
CONFIGS = [pytest.param(T3, id="K4-2"), pytest.param(T4, id="4tiers-sink"), pytest.param(TKV, id="K4V2-K2V2")]
# 3-bit codes (runs of 8 codes in 3 bytes) then 1 bit: a side whose pieces mix the two layouts
T31 = dict(k_bits=3, v_bits=3, group_size=16, residual_length=16, block_size=32, sink_tokens=2,
           tiers=[(16, None), (48, 3), (None, 1)])
DECODE_CONFIGS = CONFIGS + [pytest.param(T31, id="K3V3-1")]


def _data(B, H, T, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)


def _fill(cfg, k, v, chunks):
    layer, pos, views = KiviLayer(cfg), 0, None
    for n in chunks:
        views = layer.append(k[:, :, pos:pos + n], v[:, :, pos:pos + n])
        pos += n
    return layer, views


def _stored(layer):
    """Per side: [(bits, first, last)] of the tier stores, oldest first, and everything materialised."""
    return {name: [(s.template.bits if s.template is not None else None, s.start, s.length)
                   for s in side.chain] for name, side in (("k", layer.k), ("v", layer.v))}


# --------------------------------------------------------------------------- where tokens are


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("seen", [1, 47, 131, 300])
def test_tier_counts_follow_the_schedule(kw, seen):
    cfg = KiviConfig(**kw)
    k, v = _data(1, 2, seen, 32)
    layer, _ = _fill(cfg, k, v, [seen])
    for axis, side in (("channel", layer.k), ("token", layer.v)):
        sink, stored, _ = side_tokens(axis, seen, cfg.residual_length, cfg.group_size, cfg.sink_tokens)
        counts = tier_tokens(axis, stored, tier_keeps(cfg.tiers), cfg.group_size)  # newest first
        assert [s.length - s.start for s in side.chain] == list(reversed(counts))
        assert side.chain[0].start == sink and side.chain[-1].length == sink + stored
        for older, newer in zip(side.chain, side.chain[1:]):
            assert older.length == newer.start  # contiguous


@pytest.mark.parametrize("kw", CONFIGS)
def test_state_does_not_depend_on_chunking(kw):
    """One prefill, decode steps, or uneven chunks: the same codes in the same tiers, bit for bit."""
    cfg = KiviConfig(**kw)
    k, v = _data(2, 2, 211, 32)
    a, va = _fill(cfg, k, v, [211])
    b, _ = _fill(cfg, k, v, [100] + [1] * 111)
    c, _ = _fill(cfg, k, v, [5, 37, 1, 64, 3, 101])
    for other in (b, c):
        assert _stored(other) == _stored(a)
        for s1, s2 in zip(a.k.chain + a.v.chain, other.k.chain + other.v.chain):
            r1, r2 = s1.read(), s2.read()
            for f in ("packed", "scale", "offset"):
                assert torch.equal(getattr(r1, f), getattr(r2, f))


def test_old_tokens_are_demoted_codes_of_their_first_quantization():
    """Tier-2 tokens hold exactly demote(quantize at 4 bits): no re-read of full precision."""
    cfg = KiviConfig(**T3)
    k, v = _data(1, 2, 200, 32)
    layer, _ = _fill(cfg, k, v, [90] + [1] * 110)
    old_k, old_v = layer.k.chain[0], layer.v.chain[0]
    assert old_k.template.bits == 2 and old_k.length == 112  # 200 - 32..47 window - 48..63 in tier 4
    want_k = dequantize_kv(demote_kv(quantize_kv(k[:, :, :112], "channel", 4, 16), 2))
    want_v = dequantize_kv(demote_kv(quantize_kv(v[:, :, :old_v.length], "token", 4, 16), 2))
    assert torch.equal(dequantize_kv(old_k.read()), want_k)
    assert torch.equal(dequantize_kv(old_v.read()), want_v)
    # and the 4-bit tier is plain 4-bit quantization
    mid = layer.k.chain[1]
    assert torch.equal(
        dequantize_kv(mid.read()), dequantize_kv(quantize_kv(k[:, :, mid.start : mid.length], "channel", 4, 16))
    )


def test_untiered_config_keeps_one_store():
    layer = KiviLayer(KiviConfig())
    assert layer.k.chain == [layer.k.store] and isinstance(layer.k.store, BlockStore)


# --------------------------------------------------------------------------- every backend


@pytest.mark.parametrize("kw", DECODE_CONFIGS)
@pytest.mark.parametrize("total", [1, 67, 250])
@pytest.mark.parametrize("ratio", [1, 3])  # GQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_decode_backends_match_reference(kw, total, ratio, dtype):
    cfg = KiviConfig(**kw)
    B, hkv, D = 2, 2, 32
    k, v = _data(B, hkv, total, D, dtype)
    k[:, :, : min(total, 20)] = 0.5  # all-constant groups
    _, views = _fill(cfg, k, v, [total - 1, 1] if total > 1 else [1])
    q = torch.randn(B, hkv * ratio, 1, D).to(dtype)
    ref = reference_attention(q, *views)
    assert materialize(views[0]).shape[-2] == total
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    outs = {"blocked": blocked_attention(q, *views, block_tokens=16),
            # Triton reads one width per side: interface.run_backend sends tiered views to the blocked path
            "triton": run_backend("triton", q, *views, scaling=None, attention_mask=None)}
    if numba_available():  # the fused kernel reads each piece at its own width (the _BITS column)
        assert fused_decode_supported(q, *views)
        outs["fused"] = fused_decode_attention(q, *views, threaded=False)
        outs["fused_threads"] = fused_decode_attention(q, *views, threaded=True)
    for name, out in outs.items():
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("kw", DECODE_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_decode_steps_match_reference(kw, dtype):
    """Decode steps after a prefill: the newest tier's first block is partly demoted into the next tier,
    and the fused kernel's rows must not read those tokens a second time at the wider width."""
    if not numba_available():
        pytest.skip("numba not installed")
    cfg = KiviConfig(**kw)
    k, v = _data(1, 2, 190, 32, dtype)
    layer, _ = _fill(cfg, k, v, [150])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(150, 190):
        views = layer.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
        q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(i)).to(dtype)
        assert fused_decode_supported(q, *views)
        torch.testing.assert_close(fused_decode_attention(q, *views, threaded=False).float(),
                                   reference_attention(q, *views).float(), atol=tol, rtol=tol, msg=f"token {i}")


@pytest.mark.parametrize("kw", CONFIGS)
def test_multi_token_forward_matches_reference(kw):
    """A chunk into a non-empty tiered layer: per-query views, blocked == reference."""
    cfg = KiviConfig(**kw)
    k, v = _data(1, 2, 180, 32)
    _, views = _fill(cfg, k, v, [150, 30])
    assert views[0].tiered and views[0].per_query
    q = torch.randn(1, 4, 30, 32)
    torch.testing.assert_close(blocked_attention(q, *views, block_tokens=24, query_chunk=8),
                               reference_attention(q, *views), atol=1e-4, rtol=1e-4)


def test_view_reads_the_tiers_as_they_were_before_this_forwards_demotions():
    cfg = KiviConfig(**T3)
    k, v = _data(1, 1, 120, 32)
    layer, _ = _fill(cfg, k, v, [119])
    before = materialize(layer.append(k[:, :, 119:], v[:, :, 119:])[0])
    fresh, _ = _fill(cfg, k, v, [119])
    kv = fresh.k.chain
    want = torch.cat([dequantize_kv(s.read()) for s in kv if s.length > s.start] + [fresh.k.window, k[:, :, 119:]], -2)
    assert torch.equal(before, want)


# --------------------------------------------------------------------------- multi-token forwards = one-token decoding
# Each query of a forward of n tokens reads every token at the tier one-token decoding would give it at
# that query's step (kivi.cache.schedule.query_tier_ranges): tokens the forward's earlier steps demote
# and, in forwards longer than a tier, tokens leaving the window that are demoted within the forward.


def _one_token_vs_forward(kw, P, n, dtype, backend, ratio=2, B=1, H=2, D=32, seed=0):
    """Attention of n queries: one-token decoding (one append per query) against one forward of n tokens
    into the same layer state after a P-token prefill; (one-token outputs, forward outputs, forward views)."""
    cfg = KiviConfig(**kw)
    k, v = _data(B, H, P + n, D, dtype, seed)
    q = torch.randn(B, H * ratio, n, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    steps, _ = _fill(cfg, k, v, [P] if P else [])
    outs = []
    for i in range(n):
        views = steps.append(k[:, :, P + i:P + i + 1], v[:, :, P + i:P + i + 1])
        outs.append(run_backend(backend, q[:, :, i:i + 1], *views, scaling=None, attention_mask=None))
    layer, _ = _fill(cfg, k, v, [P] if P else [])
    views = layer.append(k[:, :, P:], v[:, :, P:])
    return torch.cat(outs, dim=2), run_backend(backend, q, *views, scaling=None, attention_mask=None), views


@pytest.mark.parametrize("kw", [*CONFIGS, pytest.param({**T3, "quantize_after": 100}, id="K4-2-after100")])
@pytest.mark.parametrize("P,n", [(150, 7), (97, 61), (5, 140), (203, 33)], ids=["verify", "chunk", "long", "odd"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_multi_token_forward_equals_one_token_decoding(kw, P, n, backend, dtype):
    """Tier sizes of 32..64 tokens: demotions happen inside every one of these forwards (and in "long",
    tokens leave the window and are demoted within the same forward)."""
    one, multi, views = _one_token_vs_forward(kw, P, n, dtype, backend)
    assert views[1].per_query  # values leave the window (and push one token down a tier) every step
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(multi.float(), one.float(), atol=tol, rtol=tol)


def test_forward_reads_tokens_its_earlier_steps_demoted():
    """A verify-sized forward (9 tokens, values move one token per step): the first query reads every
    stored token at its tier before the forward, the last reads at 2 bits tokens the first reads at 4."""
    one, multi, views = _one_token_vs_forward(T3, 150, 9, torch.float32, "reference", seed=3)
    assert views[1].region is not None
    choice = views[1].region.choice
    assert int(choice[0].max()) == 0
    assert int((choice[-1] == 2).sum()) == 8  # the 8 values the 8 later steps push out of the 4-bit tier
    torch.testing.assert_close(multi, one, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- padding, crop, rollback, batch edits


def test_padding_stays_out_of_statistics():
    cfg = KiviConfig(**T3)
    k, v = _data(2, 2, 160, 32)
    valid = torch.ones(2, 160, dtype=torch.bool)
    valid[1, :9] = False
    k[1, :, :9] = 1e4  # padding far out of range: would wreck the key groups' ranges if counted
    layer = KiviLayer(cfg)
    layer.append(k, v, valid=valid)
    got = materialize(_next_view(layer))[1, :, 9:16]
    assert (got - k[1, :, 9:16]).abs().max() < 1.0


def _next_view(layer):
    """The keys' view of one more (random) token appended to ``layer``."""
    k, v = _data(layer.k.window.shape[0], layer.k.window.shape[1], 1, layer.k.window.shape[-1], seed=9)
    return layer.append(k, v)[0]


@pytest.mark.parametrize("kw", CONFIGS)
def test_crop_within_window_and_newest_tier(kw):
    cfg = KiviConfig(**kw)
    k, v = _data(1, 2, 200, 32)
    layer, _ = _fill(cfg, k, v, [200])
    # within the window: exact
    layer.crop(-5)
    assert layer.get_seq_length() == 195
    assert torch.equal(layer.k.window[:, :, -3:], k[:, :, 192:195])
    # into the newest tier: allowed (what survives of the last key group comes back dequantized)
    newest = layer.k.chain[-1]
    to = newest.start + cfg.group_size + 3
    layer.crop(to - 195)
    assert layer.get_seq_length() == to and materialize(_next_view(layer)).shape[-2] == to + 1


@pytest.mark.parametrize("kw", CONFIGS)
def test_crop_into_a_demoted_tier_is_refused_and_changes_nothing(kw):
    cfg = KiviConfig(**kw)
    k, v = _data(1, 2, 260, 32)
    layer, _ = _fill(cfg, k, v, [260])
    before, nbytes = _stored(layer), layer.nbytes
    with pytest.raises(ValueError, match="demoted to a narrower position tier"):
        layer.crop(-(260 - layer.k.chain[-1].start + 1))
    assert _stored(layer) == before and layer.nbytes == nbytes and layer.get_seq_length() == 260


def test_failed_append_leaves_every_tier_as_it_was():
    cfg = KiviConfig(**T3)
    k, v = _data(1, 2, 300, 32)
    layer, _ = _fill(cfg, k, v, [250])
    before, nbytes = _stored(layer), layer.nbytes
    ref = materialize(_next_view(copy.deepcopy(layer)))
    bad = k[:, :, 250:].clone()
    bad[0, 0, 0, 0] = float("nan")  # leaves the window in this append
    with pytest.raises(ValueError):
        layer.append(bad, v[:, :, 250:])
    assert _stored(layer) == before and layer.nbytes == nbytes
    assert torch.equal(materialize(_next_view(layer)), ref)


def test_reorder_and_deepcopy_cover_every_tier():
    cfg = KiviConfig(**T4)
    k, v = _data(3, 2, 240, 32)
    layer, _ = _fill(cfg, k, v, [200, 40])
    dup = copy.deepcopy(layer)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    a, b = materialize(_next_view(layer)), materialize(_next_view(dup))
    assert torch.equal(a[:, :, :-1], b[[2, 0, 1], :, :-1])


# --------------------------------------------------------------------------- refusals


def test_sliding_layers_refuse_tiers():
    with pytest.raises(ValueError, match="sliding-window layers"):
        SlidingKiviLayer(KiviConfig(**T3), sliding_window=64)


# --------------------------------------------------------------------------- the planner, byte for byte


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("P,T", [(1, 1), (5, 90), (100, 100), (100, 333), (257, 400), (40, 41), (700, 733)])
def test_planner_is_byte_exact(kw, P, T):
    cfg = KiviConfig(**kw)
    k, v = _data(1, 2, T, 32)
    layer, _ = _fill(cfg, k, v, [P] + [1] * (T - P))
    assert sum(layer_bytes(cfg, 32, 2, torch.float32, T, P, None).values()) == layer.nbytes


def test_continuous_batching_refuses_tiers():
    from kivi.batching.layout import build_layout
    from tests.helpers import tiny_model

    with pytest.raises(ValueError, match=r"position tiers \(a page holds one width per side\): not supported by KIVI"):
        build_layout(tiny_model().config, KiviConfig(**T3), 64, torch.float32)


def test_per_layer_tiers_override():
    cfg = KiviConfig(**{**T3, "layer_specific_config": {1: {"tiers": None}}})
    assert len(KiviLayer(cfg.for_layer(0)).k.chain) == 2 and len(KiviLayer(cfg.for_layer(1)).k.chain) == 1
