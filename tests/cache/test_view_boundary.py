"""Per-query precision of multi-token forwards (AttentionView ``region``) and exact crop.

A forward of n tokens must give query i what one-token decoding gives it at step p + i; the
reference and the blocked backends read the boundary; crop after a recorded forward leaves the
layer exactly as one-token decoding of the kept tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from kivi.attention.blocked import blocked_attention
from kivi.attention.reference import reference_attention
from kivi.cache.layer import KiviLayer
from kivi.cache.schedule import KEY_AXIS, VALUE_AXIS, prefill_exact_queries, query_boundaries, side_tokens
from kivi.cache.view import exact_queries, materialize
from kivi.config import KiviConfig

BASE = dict(group_size=8, residual_length=16, block_size=32)
CFGS = {
    "k2v2": dict(k_bits=2, v_bits=2),
    "k4v2-sink": dict(k_bits=4, v_bits=2, sink_tokens=3),
    "k4v4": dict(k_bits=4, v_bits=4),
    "k3v2-comp": dict(k_bits=3, v_bits=2, residual_bits=2),
    "fp-values": dict(k_bits=2, quantize_value=False),
}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _exits(view):
    """Per query, how many of the region's tokens it reads as they are once out of the window (a plain
    side's region: two versions, each query reading a prefix from the second)."""
    r = view.region
    assert len(r.versions) == 2 and r.first == view.split
    exits = tuple(int(x) for x in r.choice.sum(dim=1))
    pos = torch.arange(r.choice.shape[1])
    assert torch.equal(r.choice.bool(), pos[None, :] < torch.tensor(exits)[:, None])  # prefixes
    return exits


# --------------------------------------------------------------------------- the rule


def test_query_boundaries_by_example():
    # values leave the window once more than R = 16 newer ones exist: one per query here
    assert query_boundaries(VALUE_AXIS, 16, 5, 16, 8, 0, 0) == (0, 1, 2, 3, 4)
    # keys leave in whole groups of 8 once 16 newer remain: the query at window + 8 sees one group gone
    assert query_boundaries(KEY_AXIS, 16, 10, 16, 8, 0, 0) == (0,) * 8 + (8, 8)
    assert query_boundaries(KEY_AXIS, 16, 8, 16, 8, 0, 0) is None  # nothing leaves during the forward
    assert query_boundaries(VALUE_AXIS, 16, 1, 16, 8, 0, 0) is None  # a decode step never has one
    # a prefill's prompt queries read full precision; the candidates after them do not
    assert query_boundaries(VALUE_AXIS, 0, 20, 16, 8, 0, 0, exact=20) is None
    assert query_boundaries(VALUE_AXIS, 0, 20, 16, 8, 0, 0, exact=18) == (0,) * 18 + (2, 3)
    assert prefill_exact_queries(0, 20, None) == 20 and prefill_exact_queries(0, 20, 18) == 18
    assert prefill_exact_queries(5, 20, 18) == 0  # only a forward into an empty layer is a prefill


@pytest.mark.parametrize("axis", [KEY_AXIS, VALUE_AXIS])
def test_query_boundaries_follow_the_one_token_schedule(axis):
    """split + e_i is where side_tokens(seen + i) says the window starts, for random shapes."""
    rng = random.Random(0)
    for _ in range(300):
        G = rng.choice([1, 4, 8])
        R = G * rng.randint(1, 4)
        S = rng.choice([0, 0, 3, 4])
        seen, n = rng.randint(1, 120), rng.randint(2, 40)
        sink, stored, window = side_tokens(axis, seen, R, G, S)
        bounds = query_boundaries(axis, window, n, R, G, sink, S) or (0,) * n
        for i, e in enumerate(bounds):
            s2, st2, _ = side_tokens(axis, seen + i, R, G, S)
            assert sink + stored + e == s2 + st2, (axis, G, R, S, seen, n, i)


# --------------------------------------------------------------------------- attention


def _qkv(t, b=2, hkv=2, g=3, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    return r(b, hkv * g, t, d), r(b, hkv, t, d), r(b, hkv, t, d)


def _one_token_decoding(cfg, q, k, v, t0, attend):
    layer = KiviLayer(cfg)
    layer.append(k[:, :, :t0], v[:, :, :t0])
    outs = []
    for t in range(t0, k.shape[2]):
        kv, vv = layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(attend(q[:, :, t : t + 1], kv, vv))
    return torch.cat(outs, dim=2)


CASES = [(name, torch.float32, t0, n) for name in CFGS for t0, n in [(23, 13), (37, 24), (2, 3)]] + [
    ("k2v2", torch.bfloat16, 23, 13), ("k4v2-sink", torch.float16, 37, 24),
    ("k2v2", torch.float16, 5, 29), ("k4v2-sink", torch.bfloat16, 5, 29),
]


@pytest.mark.parametrize("name,dtype,t0,n", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}+{c[3]}" for c in CASES])
def test_a_forward_of_n_tokens_equals_one_token_decoding(name, dtype, t0, n):
    cfg = KiviConfig(**BASE, **CFGS[name])
    q, k, v = _qkv(t0 + n, dtype=dtype)
    layer = KiviLayer(cfg)
    layer.append(k[:, :, :t0], v[:, :, :t0])
    kv, vv = layer.append(k[:, :, t0:], v[:, :, t0:])
    backends = {
        "reference": reference_attention,
        "blocked": lambda q_, a, b: blocked_attention(q_, a, b, block_tokens=8, query_chunk=5),
    }
    for attend in backends.values():
        want = _one_token_decoding(cfg, q, k, v, t0, attend).float()
        got = attend(q[:, :, t0:], kv, vv).float()
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float32 and (kv.per_query or vv.per_query):  # without the boundary: later queries differ
        kv.region = vv.region = None
        old = reference_attention(q[:, :, t0:], kv, vv).float()
        assert (old - want).abs().max() > 3 * TOL[dtype]


@pytest.mark.parametrize("name", list(CFGS))
def test_left_copy_is_bit_identical_to_what_the_store_then_holds(name):
    cfg = KiviConfig(**BASE, **CFGS[name])
    _, k, v = _qkv(120)
    layer = KiviLayer(cfg)
    layer.append(k[:, :, :30], v[:, :, :30])
    views = layer.append(k[:, :, 30:100], v[:, :, 30:100])
    nxt = layer.append(k[:, :, 100:101], v[:, :, 100:101])
    checked = 0
    for view, later in zip(views, nxt):
        if view.region is None:
            continue
        left = view.region.versions[1]
        m = left.shape[-2]
        exits = _exits(view)
        assert view.region.first == view.split
        assert exits == tuple(sorted(exits)) and exits[-1] == m
        seen_later = materialize(later)[:, :, view.split - later.start : view.split - later.start + m]
        assert torch.equal(seen_later, left)
        checked += 1
    assert checked


TIERS_SINK = dict(k_bits=8, v_bits=4, group_size=8, residual_length=16, block_size=32, sink_tokens=3,
                  tiers=[(16, None), (16, (8, 4)), (None, (4, 2))])


@pytest.mark.parametrize("name", [*CFGS, "tiers-sink"])
def test_each_query_reads_the_view_one_token_decoding_gives_it(name):
    """The one per-query encoding (``QueryRegion``): query ``i`` of a forward reads, bit for bit, the tokens
    of the view one-token decoding gives step ``i`` — for a plain side's boundary and a tiered side's
    demotions alike; the region's ``exact`` queries are those that read nothing from another version."""
    cfg = KiviConfig(**TIERS_SINK) if name == "tiers-sink" else KiviConfig(**BASE, **CFGS[name])
    _, k, v = _qkv(110)
    t0, n = 50, 40
    layer, steps = KiviLayer(cfg), KiviLayer(cfg)
    layer.append(k[:, :, :t0], v[:, :, :t0])
    steps.append(k[:, :, :t0], v[:, :, :t0])
    views = layer.append(k[:, :, t0:t0 + n], v[:, :, t0:t0 + n])
    assert views[0].per_query  # keys leave the window during the forward (values too, unless unquantized)
    for view in (vw for vw in views if vw.per_query):
        r = view.region
        reads_other = r.choice.bool().any(dim=1)
        assert r.exact == int(reads_other.int().argmax()) and not bool(reads_other[:r.exact].any())
        assert all(x.shape[-2] == r.choice.shape[1] for x in r.versions) and r.choice.shape[0] == n
    for i in range(n):
        step_views = steps.append(k[:, :, t0 + i:t0 + i + 1], v[:, :, t0 + i:t0 + i + 1])
        for view, step in zip(views, step_views):
            got = (materialize(view, query=i) if view.per_query else materialize(view))[:, :, : t0 + i + 1]
            assert torch.equal(got, materialize(step)), (name, i)


def test_prefill_is_exact_and_decode_steps_carry_no_boundary():
    cfg = KiviConfig(**BASE, k_bits=2, v_bits=2)
    _, k, v = _qkv(80)
    layer = KiviLayer(cfg)
    kv, vv = layer.append(k[:, :, :60], v[:, :, :60])
    assert exact_queries(60, kv) == exact_queries(60, vv) == 60  # a prefill: SDPA over exact tokens
    kv, vv = layer.append(k[:, :, 60:61], v[:, :, 60:61])
    assert not kv.per_query and not vv.per_query
    layer = KiviLayer(cfg)
    layer.prompt_length = 50  # the prompt and 10 candidates in one forward (assisted decoding)
    kv, vv = layer.append(k[:, :, :60], v[:, :, :60])
    assert vv.per_query and _exits(vv)[:50] == (0,) * 50 and _exits(vv)[50] == 50 - 16


# --------------------------------------------------------------------------- crop


def _state(layer):
    out = [layer.seen, layer.nbytes]
    for side in (layer.k, layer.v):
        out += [side.sink, side.window, side.store.length, side.store.start]
        if side.store.length > side.store.start:
            out += list(side.store.read().tensors().values()) if side.quantize else [side.store.read().data]
    return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("t0,n,keep", [(40, 12, 3), (40, 30, 29), (23, 9, 1), (3, 20, 7), (60, 5, 5)])
def test_crop_after_a_recorded_forward_equals_one_token_decoding(name, t0, n, keep):
    cfg = KiviConfig(**BASE, **CFGS[name])
    _, k, v = _qkv(t0 + n + 5, b=1)
    plain = KiviLayer(cfg)
    plain.append(k[:, :, :t0], v[:, :, :t0])
    for t in range(t0, t0 + keep):
        plain.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    spec = KiviLayer(cfg)
    spec.activate_past_recording()
    spec.append(k[:, :, :t0], v[:, :, :t0])
    spec.crop(0)
    spec.append(k[:, :, t0 : t0 + n], v[:, :, t0 : t0 + n])  # a verify forward
    spec.crop(-(n - keep))  # reject the last n - keep tokens
    _same(_state(spec), _state(plain))
    for t in range(t0 + keep, t0 + keep + 5):  # and both go on alike
        a = plain.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        b = spec.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        for x, y in zip(a, b):
            assert torch.equal(materialize(x), materialize(y))


def test_crop_without_past_recording_is_not_exact_deep_into_quantized_tokens():
    """Why past recording exists: a crop into tokens already moved into storage cannot undo them."""
    cfg = KiviConfig(**BASE, k_bits=2, v_bits=2)
    _, k, v = _qkv(80, b=1)
    plain, spec = KiviLayer(cfg), KiviLayer(cfg)
    plain.append(k[:, :, :41], v[:, :, :41])
    spec.append(k[:, :, :40], v[:, :, :40])
    spec.append(k[:, :, 40:70], v[:, :, 40:70])
    spec.crop(-29)
    assert spec.seen == plain.seen
    assert not torch.equal(materialize(spec.append(k[:, :, 41:42], v[:, :, 41:42])[1]),
                           materialize(plain.append(k[:, :, 41:42], v[:, :, 41:42])[1]))
