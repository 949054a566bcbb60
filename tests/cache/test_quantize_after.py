"""Length-aware precision (``KiviConfig.quantize_after = N``): full precision while a layer holds <= N tokens,
then, from the update that passes N, exactly the state of the plain config (docs/python.md, "Precision chosen from
the request's length")."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviCache, KiviConfig
from kivi.attention.blocked import blocked_attention
from kivi.attention.interface import run_backend
from kivi.attention.reference import reference_attention
from kivi.cache.layer import KiviLayer
from kivi.cache.schedule import KEY_AXIS, VALUE_AXIS, quantizing, query_boundaries, side_tokens, window_exits
from kivi.cache.sliding import SlidingKiviLayer
from kivi.cache.view import exact_queries, materialize
from kivi.optional import numba_available
from tests.helpers import tiny_model

BASE = dict(group_size=16, residual_length=32, block_size=64)
CFGS = {
    "k2v2": dict(k_bits=2, v_bits=2),
    "k4v2-sink": dict(k_bits=4, v_bits=2, sink_tokens=3),
    "k3v2-comp": dict(k_bits=3, v_bits=2, residual_bits=2),
    "fp-values": dict(k_bits=2, quantize_value=False),
    "clip": dict(k_bits=2, v_bits=2, clip=True),
    "tiers": dict(k_bits=4, v_bits=4, tiers=[(32, None), (48, 4), (None, 2)]),
}
N = 100


def _data(t, b=2, h=2, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g).to(dtype), torch.randn(b, h, t, d, generator=g).to(dtype)


def _fill(cfg, k, v, chunks):
    layer, pos, views = KiviLayer(cfg), 0, []
    for n in chunks:
        views.append(layer.append(k[:, :, pos:pos + n], v[:, :, pos:pos + n]))
        pos += n
    return layer, views


def _held(layer):
    """Everything a layer holds, block layout aside: per side the sink, window and each store's fields
    (token-concatenated over its blocks), oldest tier first."""
    out = {}
    for name, side in (("k", layer.k), ("v", layer.v)):
        stores = []
        for store in side.chain:
            segs = [seg.tensors() for _, seg in store.iter_blocks()]
            stores.append((store.start, store.length,
                           {f: torch.cat([s[f] for s in segs], dim=2) for f in (segs[0] if segs else {})}))
        out[name] = (side.sink, side.window, stores)
    return out


def _assert_same(a, b):
    for name in ("k", "v"):
        (sa, wa, sta), (sb, wb, stb) = a[name], b[name]
        for x, y in ((sa, sb), (wa, wb)):
            assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and torch.equal(x, y)))
        assert [(s0, s1, sorted(f)) for s0, s1, f in sta] == [(s0, s1, sorted(f)) for s0, s1, f in stb]
        for (_, _, fa), (_, _, fb) in zip(sta, stb):
            assert all(torch.equal(fa[f], fb[f]) for f in fa), name


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("axis", [KEY_AXIS, VALUE_AXIS])
@pytest.mark.parametrize("S", [0, 3])
def test_side_tokens_hold_everything_until_past_n(axis, S):
    R, G = 32, 16
    assert not quantizing(N, N) and quantizing(N + 1, N) and quantizing(1, 0)
    for seen in range(0, 260):
        got = side_tokens(axis, seen, R, G, S, quantize_after=N)
        assert got == ((0, 0, seen) if seen <= N else side_tokens(axis, seen, R, G, S)), seen


@pytest.mark.parametrize("axis", [KEY_AXIS, VALUE_AXIS])
def test_query_boundaries_follow_the_one_token_schedule_across_n(axis):
    """Query i of a forward reads what one-token decoding to ``seen + i`` tokens stored (a forward that
    crosses N quantizes for its later queries only)."""
    R, G, S = 32, 16, 3
    for seen in (0, 10, 60, 99, 100, 101, 140):
        sink, stored, window = side_tokens(axis, seen, R, G, S, quantize_after=N)
        for n in (1, 2, 7, 41, 90):
            exact = n if seen == 0 else 0
            bounds = query_boundaries(axis, window, n, R, G, sink, S, exact=exact, before=sink + stored,
                                      quantize_after=N) or (0,) * n
            for i, e in enumerate(bounds):
                if i < exact:
                    continue
                s2, st2, _ = side_tokens(axis, seen + i, R, G, S, quantize_after=N)
                assert sink + stored + e == s2 + st2, (seen, n, i)
    assert window_exits(axis, 50, R, G, 0, 0, before=50, quantize_after=N) == (0, 0)
    assert window_exits(axis, 51, R, G, 0, 0, before=50, quantize_after=N) != (0, 0)


# --------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_below_n_everything_is_full_precision_and_exact(dtype):
    cfg = KiviConfig(**BASE, **CFGS["k4v2-sink"], quantize_after=N)
    k, v = _data(N, h=3, d=48, dtype=dtype)  # odd head count and head_dim 48 (G=16)
    layer, views = _fill(cfg, k, v, [37] + [1] * (N - 37))
    assert layer.k.store.length == layer.v.store.length == 0 and layer.k.sink is None
    assert torch.equal(layer.k.window, k) and torch.equal(layer.v.window, v)
    assert layer.nbytes == 2 * k.numel() * k.element_size()  # what a DynamicCache holds
    kv, vv = views[-1]
    assert exact_queries(1, kv) == exact_queries(1, vv) == 1  # the "kivi" attention runs SDPA on it
    assert torch.equal(materialize(kv, dtype), k) and torch.equal(materialize(vv, dtype), v)


CHUNKINGS = {
    "prefill-past-n": [131, 1, 1, 50],
    "steps-across-n": [40] + [1] * 143,
    "chunk-across-n": [60, 57, 1, 31, 34],
    "at-n-then-steps": [N] + [1] * 83,
}


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("chunks", list(CHUNKINGS), ids=list(CHUNKINGS))
def test_after_n_the_state_is_the_plain_configs(name, chunks):
    """Past N the layer holds, bit for bit, what the plain config holds after the same tokens (codes,
    scales, sinks, windows; only the block layout may differ: the first stored append is the crossing)."""
    plain = KiviConfig(**BASE, **CFGS[name])
    gated = KiviConfig(**BASE, **CFGS[name], quantize_after=N)
    chunks = CHUNKINGS[chunks]
    k, v = _data(sum(chunks))
    a, _ = _fill(plain, k, v, chunks)
    b, _ = _fill(gated, k, v, chunks)
    _assert_same(_held(a), _held(b))
    # and at every step after the crossing: one-token decoding compared view by view
    pos = sum(chunks)
    kk, vv = _data(5, seed=1)
    for t in range(5):
        va = a.append(kk[:, :, t:t + 1], vv[:, :, t:t + 1])
        vb = b.append(kk[:, :, t:t + 1], vv[:, :, t:t + 1])
        for x, y in zip(va, vb):
            assert torch.equal(materialize(x, torch.float32), materialize(y, torch.float32)), pos + t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_after_n_the_state_is_the_plain_configs_half_precision(dtype):
    k, v = _data(170, dtype=dtype)
    chunks = [20] + [1] * 150
    a, _ = _fill(KiviConfig(**BASE, **CFGS["k4v2-sink"]), k, v, chunks)
    b, _ = _fill(KiviConfig(**BASE, **CFGS["k4v2-sink"], quantize_after=N), k, v, chunks)
    _assert_same(_held(a), _held(b))


def test_padding_marks_carry_across_n():
    """Left padding: the marks kept in the window before N are the ones the plain config stores."""
    k, v = _data(140)
    valid = torch.ones(2, 140, dtype=torch.bool)
    valid[1, :23] = False
    out = []
    for cfg in (KiviConfig(**BASE, k_bits=2, v_bits=2), KiviConfig(**BASE, k_bits=2, v_bits=2, quantize_after=N)):
        layer = KiviLayer(cfg)
        layer.append(k[:, :, :50], v[:, :, :50], valid=valid[:, :50])
        for t in range(50, 140):
            layer.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        out.append(layer)
    _assert_same(_held(out[0]), _held(out[1]))
    # the stored keys' marks say the same (absent marks are real tokens; the crossing records one longer row)
    a, b = out[0].k.stored_valid, out[1].k.stored_valid
    assert not bool(a.all()) and torch.equal(a, b[:, :a.shape[1]]) and bool(b[:, a.shape[1]:].all())


@pytest.mark.parametrize("name", ["k2v2", "k4v2-sink"])
def test_a_forward_across_n_equals_one_token_decoding(name):
    cfg = KiviConfig(**BASE, **CFGS[name], quantize_after=N)
    g = torch.Generator().manual_seed(3)
    t0, n = 70, 61  # the forward holds 71..131 tokens: its first 30 queries read everything exact
    q = torch.randn(2, 6, t0 + n, 32, generator=g)  # GQA: 3 query heads per kv head
    k, v = _data(t0 + n)
    layer, _ = _fill(cfg, k, v, [t0])
    kv, vv = layer.append(k[:, :, t0:], v[:, :, t0:])
    assert kv.per_query
    for attend in (reference_attention, lambda q_, a, b: blocked_attention(q_, a, b, block_tokens=16, query_chunk=7)):
        step, outs = _fill(cfg, k, v, [t0])[0], []
        for t in range(t0, t0 + n):
            a, b = step.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
            outs.append(attend(q[:, :, t:t + 1], a, b))
        torch.testing.assert_close(attend(q[:, :, t0:], kv, vv), torch.cat(outs, dim=2), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_backends_agree_across_n():
    """Decode steps before, at and after the crossing: the cpu backend (fused numba kernel) and the
    blocked path equal the reference."""
    cfg = KiviConfig(**BASE, **CFGS["k4v2-sink"], quantize_after=N)
    k, v = _data(N + 40, h=2)
    q = torch.randn(2, 4, N + 40, 32, generator=torch.Generator().manual_seed(5))
    layer, _ = _fill(cfg, k, v, [N - 3])
    for t in range(N - 3, N + 40):
        kv, vv = layer.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        want = reference_attention(q[:, :, t:t + 1], kv, vv)
        for backend in ("cpu", "blocked"):
            got = (run_backend("cpu", q[:, :, t:t + 1], kv, vv, scaling=None, attention_mask=None)
                   if backend == "cpu" else blocked_attention(q[:, :, t:t + 1], kv, vv))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert layer.k.store.length > 0


def test_per_head_layers_follow_the_policy():
    model = tiny_model(num_hidden_layers=2)
    cfg = KiviConfig(**BASE, quantize_after=N, head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 4]}})
    cache = KiviCache.from_model(model, cfg)
    ids = torch.randint(1, 100, (1, N + 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :N], cache=cache, use_cache=True)
        assert all(p.k.store.length == 0 for p in cache.layers[0].parts)
        model(ids[:, N:N + 1], cache=cache, use_cache=True)
        assert all(p.k.store.length > 0 for p in cache.layers[0].parts)


# --------------------------------------------------------------------------- with a model


def _logits(model, cache, ids, prefill, mask=None):
    outs = []
    with torch.no_grad():
        for s, e in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]:
            kw = {} if mask is None else {"attention_mask": mask[:, :e],
                                          "position_ids": (mask.long().cumsum(-1) - 1).clamp_min(0)[:, s:e]}
            outs.append(model(input_ids=ids[:, s:e], cache=cache, use_cache=True, **kw).logits)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_model_below_n_equals_dynamic_cache_and_past_n_quantizes(backend):
    """Logits of every token whose forward finds <= N tokens cached equal DynamicCache's bit for bit (padded
    GQA batch); the next ones are KIVI's."""
    from transformers import DynamicCache

    from kivi import quantize_model
    model = tiny_model(num_hidden_layers=2, weight_scale=3.0)
    ids = torch.randint(1, 100, (2, N + 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want = _logits(model, DynamicCache(config=model.config), ids, 30, mask)
    quantize_model(model, KiviConfig(**BASE, k_bits=2, v_bits=2, quantize_after=N, attention_backend=backend))
    cache = KiviCache.from_model(model)
    got = _logits(model, cache, ids, 30, mask)
    assert torch.equal(got[:, :N + 1], want[:, :N + 1])
    assert not torch.equal(got[:, N + 1:], want[:, N + 1:])  # token N+1 reads quantized keys
    assert cache.layers[0].k.store.length > 0


def test_prefill_past_n_equals_the_plain_config():
    model = tiny_model(num_hidden_layers=2)
    ids = torch.randint(1, 100, (1, 180), generator=torch.Generator().manual_seed(4))
    runs = []
    for q in (0, N):
        cache = KiviCache.from_model(model, KiviConfig(**BASE, k_bits=2, v_bits=2, quantize_after=q))
        runs.append(_logits(model, cache, ids, 150))
    assert torch.equal(runs[0], runs[1])


# --------------------------------------------------------------------------- config and refusals


def test_config_round_trip_and_per_layer_override():
    cfg = KiviConfig(quantize_after=4096, layer_specific_config={1: {"quantize_after": 0}})
    again = KiviConfig.from_json(cfg.to_json())
    assert again == cfg and again.for_layer(0).quantize_after == 4096 and again.for_layer(1).quantize_after == 0
    assert "fp<=4096" in cfg.describe()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "512"])
def test_bad_values_name_the_field(bad):
    with pytest.raises(ValueError, match=r"^quantize_after=.* must be an integer >= 0$"):
        KiviConfig(quantize_after=bad)
    with pytest.raises(ValueError, match=r"^layer_specific_config\[2\]\.quantize_after="):
        KiviConfig(layer_specific_config={2: {"quantize_after": bad}})


def test_sliding_layers_are_refused_in_one_line():
    model = tiny_model("mistral", sliding_window=64)
    with pytest.raises(ValueError, match="quantize_after is not supported on sliding-window layers"):
        KiviCache.from_model(model, KiviConfig(quantize_after=256))
    with pytest.raises(ValueError, match="quantize_after=256 is not supported on sliding-window layers"):
        SlidingKiviLayer(KiviConfig(quantize_after=256), sliding_window=64)
    # per-layer override to 0 on the sliding layers is the way out
    n = model.config.num_hidden_layers
    KiviCache.from_model(model, KiviConfig(quantize_after=256, layer_specific_config={
        i: {"quantize_after": 0} for i in range(n)}))


def test_continuous_batching_pages_are_refused():
    from kivi.batching.layout import build_layout

    model = tiny_model()
    with pytest.raises(ValueError,
                       match=r"quantize_after=64: full precision before quantizing .*not supported by KIVI pages"):
        build_layout(model.config, KiviConfig(quantize_after=64), 32, torch.float32)


@pytest.mark.parametrize("t0,n,keep", [(90, 20, 5), (90, 20, 15), (95, 30, 30), (120, 9, 2)],
                         ids=["keep-below-n", "keep-past-n", "keep-all", "after-n"])
def test_speculative_crop_across_n_equals_one_token_decoding(t0, n, keep):
    """A recorded verify forward that crosses N, cropped back (to below or past N): the layer is what
    one-token decoding of the kept tokens gives, and both go on alike."""
    cfg = KiviConfig(**BASE, **CFGS["k4v2-sink"], quantize_after=N)
    k, v = _data(t0 + n + 5, b=1)
    plain, _ = _fill(cfg, k, v, [t0] + [1] * keep)
    spec = KiviLayer(cfg)
    spec.activate_past_recording()
    spec.append(k[:, :, :t0], v[:, :, :t0])
    spec.crop(0)
    spec.append(k[:, :, t0:t0 + n], v[:, :, t0:t0 + n])
    spec.crop(-(n - keep))
    _assert_same(_held(spec), _held(plain))
    assert spec.seen == plain.seen == t0 + keep
    for t in range(t0 + keep, t0 + keep + 5):
        a = plain.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        b = spec.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        for x, y in zip(a, b):
            assert torch.equal(materialize(x, torch.float32), materialize(y, torch.float32))
