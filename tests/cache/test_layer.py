import pytest
import torch

from kivi.cache.layer import KiviLayer
from kivi.cache.sliding import SlidingKiviLayer
from kivi.cache.view import materialize
from kivi.config import KiviConfig
from kivi.quant.kv import dequantize_kv


def _kv(b=2, h=2, t=1, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g).to(dtype), torch.randn(b, h, t, d, generator=g).to(dtype)


def _seen(layer, k, v, valid=None):
    """Append; return the keys/values the forward's FIRST query sees (the pre-move history + the new
    tokens, no per-query boundary applied): what these tests check about storage."""
    kv, vv = layer.append(k, v, valid=valid)
    return materialize(kv, layer.dtype), materialize(vv, layer.dtype)


def _feed(layer, k, v, chunks):
    outs, s = [], 0
    for c in chunks:
        outs.append(_seen(layer, k[:, :, s : s + c], v[:, :, s : s + c]))
        s += c
    return outs


@pytest.mark.parametrize("R,G", [(128, 32), (64, 32), (0, 32), (32, 16)])
def test_window_sizes_and_group_aligned_moves(R, G):
    cfg = KiviConfig(group_size=G, residual_length=R)
    layer = KiviLayer(cfg)
    k, v = _kv(t=400)
    for t in range(400):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])  # storage only, no dequantization
        seen = t + 1
        nk = layer.k.store.length
        assert nk % G == 0  # keys move only in whole, aligned groups
        assert R <= layer.k.window_len < R + G or (seen < R + G and nk == 0)
        assert layer.v.window_len == min(seen, R)
        assert nk + layer.k.window_len == seen == layer.v.store.length + layer.v.window_len


def test_window_is_bit_exact():
    cfg = KiviConfig(residual_length=64)
    layer = KiviLayer(cfg)
    k, v = _kv(t=300, dtype=torch.bfloat16)
    _feed(layer, k, v, [100, 1, 1, 77, 121])
    assert torch.equal(layer.k.window, k[:, :, layer.k.store.length :])
    assert torch.equal(layer.v.window, v[:, :, layer.v.store.length :])


def test_new_tokens_are_seen_at_full_precision_and_history_as_stored():
    layer = KiviLayer(KiviConfig(residual_length=32))
    k, v = _kv(t=200)
    keys, values = _seen(layer, k[:, :, :150], v[:, :, :150])
    assert torch.equal(keys, k[:, :, :150]) and torch.equal(values, v[:, :, :150])  # prefill: own tokens FP
    keys, values = _seen(layer, k[:, :, 150:160], v[:, :, 150:160])
    assert torch.equal(keys[:, :, 150:], k[:, :, 150:160])
    stored_k = dequantize_kv(layer.k.store.read(96))
    assert torch.equal(keys[:, :, :96], stored_k)
    assert not torch.equal(keys[:, :, :96], k[:, :, :96])


def test_history_is_never_requantized():
    layer = KiviLayer(KiviConfig(residual_length=32, block_size=64))
    k, v = _kv(t=400)
    _seen(layer, k[:, :, :100], v[:, :, :100])
    before_k = layer.k.store.read().packed.clone()
    before_v = layer.v.store.read().scale.clone()
    for t in range(100, 400):
        _seen(layer, k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert torch.equal(layer.k.store.read(before_k.shape[2]).packed, before_k)
    assert torch.equal(layer.v.store.read(before_v.shape[2]).scale, before_v)


def test_chunk_sees_history_exactly_as_a_single_token_step_would():
    """The tokens before a chunk look the same to the chunk as to a one-token forward at that point."""
    k, v = _kv(t=300)
    a, b = KiviLayer(KiviConfig(residual_length=64)), KiviLayer(KiviConfig(residual_length=64))
    _feed(a, k, v, [128] + [1] * 160)  # a is now at 288 tokens
    ka, va = _seen(a, k[:, :, 288:289], v[:, :, 288:289])
    _feed(b, k, v, [128] + [16] * 10)
    kb, vb = _seen(b, k[:, :, 288:300], v[:, :, 288:300])
    assert torch.equal(ka[:, :, :289], kb[:, :, :289]) and torch.equal(va[:, :, :289], vb[:, :, :289])
    assert torch.equal(kb[:, :, 288:], k[:, :, 288:300])  # the chunk's own tokens at full precision
    # and both hold the same quantized history afterwards
    _feed(a, k, v, [1] * 11)
    assert torch.equal(a.k.store.read().packed, b.k.store.read().packed)
    assert torch.equal(a.v.store.read().packed, b.v.store.read().packed)


def test_quantization_off_is_exact():
    layer = KiviLayer(KiviConfig(quantize_key=False, quantize_value=False))
    k, v = _kv(t=500)
    outs = _feed(layer, k, v, [300, 1, 199])
    assert torch.equal(outs[-1][0], k) and torch.equal(outs[-1][1], v)
    assert layer.memory_breakdown()["codes"] == 0


def test_crop_within_window_is_exact_and_beyond_window_keeps_group_alignment():
    layer = KiviLayer(KiviConfig(residual_length=32))
    k, v = _kv(t=300)
    _feed(layer, k, v, [200, 10])
    layer.crop(-5)
    assert layer.get_seq_length() == 205
    keys, values = _seen(layer, k[:, :, 205:206], v[:, :, 205:206])
    assert keys.shape[2] == 206 and torch.equal(keys[:, :, 173:], k[:, :, 173:206])
    layer.crop(-100)  # reaches into quantized keys: partial group comes back dequantized
    assert layer.get_seq_length() == 106
    assert layer.k.store.length % 32 == 0
    assert layer.k.store.length + layer.k.window_len == 106 == layer.v.store.length + layer.v.window_len
    keys, _ = _seen(layer, k[:, :, 106:107], v[:, :, 106:107])
    assert keys.shape[2] == 107
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


def test_reorder_and_batch_ops():
    layer = KiviLayer(KiviConfig(residual_length=32))
    k, v = _kv(b=3, t=150)
    _seen(layer, k, v)
    ref = [materialize(x) for x in layer.append(k[:, :, :1], v[:, :, :1])]
    idx = torch.tensor([2, 0, 0])
    layer2 = KiviLayer(KiviConfig(residual_length=32))
    _seen(layer2, k, v)
    layer2.reorder_cache(idx)
    got = [materialize(x) for x in layer2.append(k[idx, :, :1], v[idx, :, :1])]
    assert torch.equal(got[0], ref[0][idx]) and torch.equal(got[1], ref[1][idx])
    layer2.batch_select_indices(torch.tensor([1]))
    layer2.batch_repeat_interleave(2)
    assert layer2.k.window.shape[0] == 2 and layer2.k.store.read().packed.shape[0] == 2


def test_padding_does_not_change_real_tokens():
    cfg = KiviConfig(residual_length=32)
    k, v = _kv(b=2, t=200)
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[1, :45] = False
    res = []
    for fill in (0.0, 1e3):
        kk, vv = k.clone(), v.clone()
        kk[1, :, :45] = fill
        vv[1, :, :45] = fill
        layer = KiviLayer(cfg)
        _seen(layer, kk[:, :, :120], vv[:, :, :120], valid=valid[:, :120])
        out = _seen(layer, kk[:, :, 120:], vv[:, :, 120:], valid=valid[:, 120:])
        out = _seen(layer, kk[:, :, -1:], vv[:, :, -1:], valid=valid[:, -1:])
        res.append(out)
    assert torch.equal(res[0][0][1, :, 45:], res[1][0][1, :, 45:])
    assert torch.equal(res[0][1][1, :, 45:], res[1][1][1, :, 45:])
    assert torch.isfinite(res[1][0]).all()


def test_nan_input_raises():
    layer = KiviLayer(KiviConfig(residual_length=0))
    k, v = _kv(t=64)
    k[0, 0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        _seen(layer, k, v)


def test_group_size_must_divide_head_dim():
    layer = KiviLayer(KiviConfig(group_size=48, residual_length=48, block_size=96))
    with pytest.raises(ValueError, match="head_dim=64"):
        _seen(layer, *_kv(t=4))


def test_sliding_layer_frees_blocks_and_reports_offset():
    layer = SlidingKiviLayer(KiviConfig(residual_length=32, block_size=64), sliding_window=64)
    k, v = _kv(t=1000)
    for s in range(0, 1000, 50):
        _seen(layer, k[:, :, s : s + 50], v[:, :, s : s + 50])
    kv_len, off = layer.get_mask_sizes(1)
    assert off > 0 and off % 64 == 0 and off <= 1000 - 64
    assert kv_len == 1000 - off + 1
    keys, _ = _seen(layer, k[:, :, :1], v[:, :, :1])
    assert keys.shape[2] == kv_len
    assert sum(b is not None for b in layer.k.store.blocks) < 1000 // 64


# --------------------------------------------------------------------------- sink tokens


@pytest.mark.parametrize("sink", [1, 4, 33])
@pytest.mark.parametrize("chunks", [[300], [100, 1, 1, 50], [1] * 40 + [200]])
def test_sink_tokens_exact_and_out_of_statistics(sink, chunks):
    cfg = KiviConfig(residual_length=32, sink_tokens=sink)
    k, v = _kv(t=sum(chunks))
    k[:, :, 0] *= 50.0  # an outlier first token that would widen every key channel group
    layer = KiviLayer(cfg)
    keys, values = _feed(layer, k, v, chunks)[-1]
    T = sum(chunks)
    assert layer.k.sink_len == layer.v.sink_len == sink
    assert torch.equal(keys[:, :, :sink], k[:, :, :sink]) and torch.equal(values[:, :, :sink], v[:, :, :sink])
    assert layer.k.store.start == layer.v.store.start == sink
    # key groups start after the sink: the stored part is a whole number of groups from `sink`
    assert (layer.k.store.length - sink) % 32 == 0
    assert layer.k.store.length + layer.k.window_len == T == layer.v.store.length + layer.v.window_len
    # the group right after the sink is quantized as if the outlier never existed
    ref = KiviLayer(KiviConfig(residual_length=32))
    _seen(ref, k[:, :, sink:], v[:, :, sink:])
    assert ref.k.store.length == layer.k.store.length - sink > 0
    assert torch.equal(dequantize_kv(layer.k.store.read()), dequantize_kv(ref.k.store.read()))
    assert torch.equal(dequantize_kv(layer.v.store.read()), dequantize_kv(ref.v.store.read()))
    # what the next forward sees: sink exact, then the stored history, then the window
    keys, values = _seen(layer, k[:, :, :1], v[:, :, :1])
    assert torch.equal(keys[:, :, :sink], k[:, :, :sink]) and torch.equal(values[:, :, :sink], v[:, :, :sink])
    assert torch.equal(keys[:, :, sink : layer.k.store.start + ref.k.store.length], dequantize_kv(ref.k.store.read()))
    bd = layer.memory_breakdown()
    assert bd["fp_sink"] == 2 * k[:, :, :sink].numel() * k.element_size()


def test_sink_with_short_sequence_and_crop():
    cfg = KiviConfig(residual_length=32, sink_tokens=4)
    k, v = _kv(t=200)
    layer = KiviLayer(cfg)
    keys, _ = _seen(layer, k[:, :, :20], v[:, :, :20])  # nothing leaves the window yet: no sink
    assert layer.k.sink_len == 0 and torch.equal(keys, k[:, :, :20])
    _feed(layer, k[:, :, 20:], v[:, :, 20:], [1] * 14)  # 34 tokens: 2 sink tokens so far
    assert layer.k.sink_len == layer.v.sink_len == 2
    _feed(layer, k[:, :, 34:], v[:, :, 34:], [150])
    assert layer.k.sink_len == 4
    layer.crop(-(184 - 3))  # into the sink
    assert layer.get_seq_length() == 3 and layer.k.sink_len == 3 and layer.k.window_len == 0
    keys, values = _seen(layer, k[:, :, 3:200], v[:, :, 3:200])
    assert keys.shape[2] == 200 and torch.equal(keys[:, :, :4], k[:, :, :4])
    assert layer.k.sink_len == 4 and (layer.k.store.length - 4) % 32 == 0
    layer.crop(-40)  # beyond the window: keeps group alignment relative to the sink
    assert (layer.k.store.length - 4) % 32 == 0 and layer.get_seq_length() == 160


def test_sink_reorder_and_sliding_layers_have_none():
    layer = KiviLayer(KiviConfig(residual_length=32, sink_tokens=2))
    k, v = _kv(t=100)  # batch of 2
    _seen(layer, k, v)
    layer.reorder_cache(torch.tensor([1, 0]))
    keys, _ = _seen(layer, k[:, :, :1], v[:, :, :1])
    assert torch.equal(keys[:, :, :2], k.flip(0)[:, :, :2])
    sliding = SlidingKiviLayer(KiviConfig(residual_length=32, sink_tokens=2), sliding_window=64)
    _seen(sliding, k, v)
    assert sliding.k.sink_len == 0 and sliding.kv_offset == 0


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_value_fast_path_stores_what_the_torch_path_stores(monkeypatch, bits):
    """Decode appends move values through quantize_tokens_into (numba); the store must be identical."""
    pytest.importorskip("numba")
    cfg = KiviConfig(k_bits=bits, v_bits=bits, residual_length=16, group_size=16, block_size=32)
    k, v = _kv(t=120)
    layers = []
    for fast in (True, False):
        layer = KiviLayer(cfg)
        if not fast:
            monkeypatch.setattr(layer.v, "_fast_tokens", lambda x: False)
        _seen(layer, k[:, :, :50], v[:, :, :50])
        for t in range(50, 120):  # crosses several 32-token blocks
            _seen(layer, k[:, :, t : t + 1], v[:, :, t : t + 1])
        layers.append(layer)
    fast, slow = layers
    assert fast.v._fast_tokens(v[:, :, :1])
    assert fast.v.store.length == slow.v.store.length == 120 - 16
    a, b = fast.v.store.read(), slow.v.store.read()
    for name in ("packed", "scale", "offset"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(fast.v.window, slow.v.window)


def test_nan_in_a_decode_value_raises_and_leaves_the_store_as_it_was():
    layer = KiviLayer(KiviConfig(residual_length=32, group_size=32, block_size=64))
    k, v = _kv(t=40)
    _seen(layer, k, v)
    before = layer.v.store.length
    assert before == 8
    k1, v1 = _kv(t=33, seed=1)
    v1[0, 0, 0, 3] = float("nan")  # leaves the 32-token window at once (33 new tokens)
    with pytest.raises(ValueError, match="NaN or Inf"):
        _seen(layer, k1, v1)
    assert layer.v.store.length == before


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("fail_at", ["nan-value", "key-quantizer", "value-store"])
def test_failed_update_leaves_the_cache_as_it_was(fail_at, sink, monkeypatch):
    """An error inside update (either side, any step) leaves the layer bit-identical to before."""
    import kivi.cache.side as side_mod
    import kivi.cache.store as store_mod
    from kivi import KiviCache

    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, sink_tokens=sink)
    g = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g))  # noqa: E731
    a, b = KiviCache(cfg), KiviCache(cfg)
    for n in (40, 1, 1, 7):
        k, v = kv(n)
        a.update(k, v, 0)
        b.update(k, v, 0)
    k, v = kv(100)
    if fail_at == "nan-value":
        v[0, 0, 50, 3] = float("nan")
    elif fail_at == "key-quantizer":
        monkeypatch.setattr(side_mod, "quantize_side", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    else:
        calls = []
        orig = store_mod.BlockStore.append_in_place

        def fail_second(self, n, write):  # keys are written first; fail when values are written
            calls.append(n)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return orig(self, n, write)

        monkeypatch.setattr(store_mod.BlockStore, "append_in_place", fail_second)
    with pytest.raises((ValueError, RuntimeError)):
        a.update(k, v, 0)
    monkeypatch.undo()
    assert a.get_seq_length() == b.get_seq_length() and a.nbytes == b.nbytes
    k, v = kv(1)
    ra, rb = a.update(k, v, 0), b.update(k, v, 0)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])


def test_crop_beyond_the_cache_names_the_cache_length():
    layer = KiviLayer(KiviConfig(group_size=8, residual_length=16, block_size=32))
    k = torch.randn(1, 2, 150, 16)
    _seen(layer, k, k)
    with pytest.raises(ValueError, match=r"crop\(-151\): the cache holds 150 tokens, so at most 150"):
        layer.crop(-151)
    assert layer.get_seq_length() == 150
    layer.crop(-150)  # everything may go
    assert layer.get_seq_length() == 0


@pytest.mark.parametrize("kwargs", [{}, {"recurrent_states_to_keep": 4}], ids=["5.24", "5.25"])
def test_past_recording_takes_what_any_transformers_5_release_passes(kwargs):
    """transformers 5.25's assisted decoding calls ``cache.activate_past_recording(recurrent_states_to_keep=n)``
    (for recurrent layers; a KIVI layer has none), 5.24 calls it without arguments: both record the past of every
    layer, and layers made later record too, so a crop after a verify forward is exact."""
    from kivi import KiviCache

    cfg = KiviConfig(group_size=8, residual_length=8, block_size=32)
    g = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g))  # noqa: E731
    cache, plain = KiviCache(cfg), KiviCache(cfg)
    k, v = kv(30)
    cache.update(k, v, 0)
    plain.update(k, v, 0)
    cache.activate_past_recording(**kwargs)
    assert cache.layers[0].record_past
    k, v = kv(30)
    cache.update(k, v, 1)  # a layer created after the call records too
    plain.update(k, v, 1)
    assert cache.layers[1].record_past
    k, v = kv(12)
    for layer in (0, 1):
        cache.update(k, v, layer)  # a verify forward of 12 tokens, then 9 of them rejected
        cache.layers[layer].crop(-9)
        plain.update(k[:, :, :3], v[:, :, :3], layer)
    for a, b in zip(cache.layers, plain.layers):
        assert a.get_seq_length() == b.get_seq_length() == 33
