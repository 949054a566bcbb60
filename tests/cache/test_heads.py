"""Per-head widths (kivi/cache/heads.py): a layer whose kv heads hold different (k_bits, v_bits)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kivi import KiviCache, KiviConfig
from kivi.cache.heads import HeadGroup, HeadSplitLayer, build_layer, head_groups, materialize_heads
from kivi.cache.layer import KiviLayer
from kivi.cache.view import materialize
from tests.helpers import tiny_model

LAYER = dict(group_size=8, residual_length=16, block_size=32)
K_BITS, V_BITS = [4, 2, 2], [2, 2, 8]  # 3 kv heads: groups (4,2), (2,2), (2,8)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _feed(layer, xs, valid=None):
    """Append each (k, v) of ``xs``; the materialised (k, v) every forward returned."""
    return [layer.update(k, v, valid=valid) for k, v in xs]


def _inputs(chunks, heads=3, dtype=torch.float32, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in chunks:
        k = (torch.randn(batch, heads, n, 16, generator=g) * 2 + torch.randn(1, heads, 1, 16, generator=g)).to(dtype)
        v = torch.randn(batch, heads, n, 16, generator=g).to(dtype)
        out.append((k, v))
    return out


def test_head_groups_are_contiguous_runs():
    assert head_groups([4, 4, 2, 4], [2, 2, 2, 2]) == [HeadGroup(0, 2, 4, 2), HeadGroup(2, 3, 2, 2),
                                                       HeadGroup(3, 4, 4, 2)]
    with pytest.raises(ValueError, match="one of each per kv head"):
        head_groups([2, 2], [2])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("sink", [0, 3])
def test_each_head_equals_a_single_width_layer(dtype, sink):
    """Head h of the split layer holds exactly what a plain layer of head h's width holds for it."""
    cfg = KiviConfig(**LAYER, sink_tokens=sink)
    chunks = [37, 1, 1, 5, 1, 19, 1]  # odd lengths, not multiples of G or block_size
    xs = _inputs(chunks, dtype=dtype)
    split = HeadSplitLayer(cfg, K_BITS, V_BITS)
    # Decode steps only (a multi-token forward after the prefill returns per-query views, checked below).
    got = _feed(split, [x for x in xs if x[0].shape[2] == 1 or x is xs[0]])
    for h, (kb, vb) in enumerate(zip(K_BITS, V_BITS)):
        plain = KiviLayer(KiviConfig(**LAYER, sink_tokens=sink, k_bits=kb, v_bits=vb))
        want = _feed(plain, [x for x in xs if x[0].shape[2] == 1 or x is xs[0]])
        for (gk, gv), (wk, wv) in zip(got, want):
            assert torch.equal(gk[:, h], wk[:, h]) and torch.equal(gv[:, h], wv[:, h])
    assert split.nbytes == sum(p.nbytes for p in split.parts) > 0
    assert split.get_seq_length() == sum(x[0].shape[2] for x in xs if x[0].shape[2] == 1 or x is xs[0])


def test_uniform_split_is_bit_identical_to_the_plain_layer():
    cfg = KiviConfig(**LAYER, k_bits=2, v_bits=2, sink_tokens=2)
    xs = _inputs([41, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    split = HeadSplitLayer(cfg, [2, 2, 2], [2, 2, 2], groups=[HeadGroup(0, 1, 2, 2), HeadGroup(1, 3, 2, 2)])
    plain = KiviLayer(cfg)
    for (gk, gv), (wk, wv) in zip(_feed(split, xs), _feed(plain, xs)):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert split.nbytes == plain.nbytes
    assert split.memory_breakdown() == plain.memory_breakdown()


def test_uniform_head_bits_model_equals_plain_config():
    model = tiny_model(num_key_value_heads=2)
    ids = torch.randint(1, 128, (2, 53))
    out = []
    for cfg in (
        KiviConfig(**LAYER, attention_backend="reference"),
        KiviConfig(**LAYER, attention_backend="reference", head_bits={0: {"k_bits": [2, 2]}, 1: {"v_bits": [2, 2]}}),
    ):
        cache = KiviCache.from_model(model, cfg)
        with torch.no_grad():
            logits = [model(ids[:, :45], cache=cache, use_cache=True).logits]
            for t in range(45, 53):
                logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
        out.append((torch.cat(logits, 1), cache.nbytes, cache))
    assert isinstance(out[1][2].layers[0], HeadSplitLayer)
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]


def test_crop_is_all_or_nothing_across_groups(monkeypatch):
    cfg = KiviConfig(**LAYER)
    layer = HeadSplitLayer(cfg, K_BITS, V_BITS)
    _feed(layer, _inputs([50, 1, 1]))
    before = _state(layer)

    def boom(new_seen, dtype):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(layer.parts[2].v, "crop", boom)  # the last group's last side fails
    with pytest.raises(RuntimeError, match="disk on fire"):
        layer.crop(-20)
    assert _same(_state(layer), before) and layer.seen == 52
    monkeypatch.undo()
    layer.crop(-20)
    assert layer.seen == 32


def test_append_fails_whole_when_a_group_fails():
    layer = HeadSplitLayer(KiviConfig(**LAYER), K_BITS, V_BITS)
    _feed(layer, _inputs([30]))
    k, v = _inputs([40], seed=1)[0]
    k[:, 2, 5, 3] = float("nan")  # the last group refuses (check_finite) after the first two appended
    nb = [p.nbytes for p in layer.parts]
    with pytest.raises(ValueError):
        layer.update(k, v)
    assert [p.nbytes for p in layer.parts] == nb and layer.seen == 30


def test_wrong_number_of_heads_is_refused():
    layer = HeadSplitLayer(KiviConfig(**LAYER), K_BITS, V_BITS)
    k, v = _inputs([5], heads=2)[0]
    with pytest.raises(ValueError, match="3 kv heads"):
        layer.update(k, v)
    with pytest.raises(ValueError, match=r"head_bits\[0\]\.k_bits has 3 widths, but the layer has 2 kv heads"):
        KiviCache.from_model(
            tiny_model(num_key_value_heads=2), KiviConfig(**LAYER, head_bits={0: {"k_bits": [4, 2, 2]}})
        )


def test_reorder_deepcopy_and_padding():
    cfg = KiviConfig(**LAYER, attention_backend="reference", head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 4]}})
    model = tiny_model(num_key_value_heads=2)
    ids = torch.randint(1, 128, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    cache = KiviCache.from_model(model, cfg)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    twin = copy.deepcopy(cache)
    assert twin.nbytes == cache.nbytes
    assert twin.layers[0].parts[0] is not cache.layers[0].parts[0]
    assert cache.layers[0].parts[0].k.stored_valid is not None  # padding marks reached every group
    assert cache.layers[0].parts[1].k.stored_valid is not None
    cache.reorder_cache(torch.tensor([1, 0]))
    k0 = cache.layers[0].parts[1].k.window
    assert torch.equal(k0[0], twin.layers[0].parts[1].k.window[1])


def test_build_layer_reads_head_bits():
    cfg = KiviConfig(**LAYER, layer_specific_config={1: {"v_bits": 4}}, head_bits={1: {"k_bits": [2, 8]}})
    assert isinstance(build_layer(cfg, 0), KiviLayer)
    layer = build_layer(cfg, 1)
    assert [(g.k_bits, g.v_bits) for g in layer.groups] == [(2, 4), (8, 4)]
    assert layer.parts[0].config.head_bits == {}


def test_per_head_widths_with_tiers_are_refused_in_one_line():
    from kivi.cache.heads import HeadSplitLayer

    cfg = KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=16, block_size=32,
                     tiers=[(16, None), (16, 4), (None, 2)])
    with pytest.raises(ValueError, match="cannot be combined with tiers"):
        HeadSplitLayer(cfg, [4, 2], [4, 4])


def _state(layer) -> list:
    """Everything the groups hold (windows, sinks, stored tensors up to their length), for bit-exact comparison;
    ``layer``: a HeadSplitLayer, or a list of plain KiviLayers (one per group)."""
    layers = [layer] if isinstance(layer, HeadSplitLayer) else list(layer)
    assert len({(lay.seen, lay.due) for lay in layers}) == 1  # plain layers fed the same steps agree
    out = [(layers[0].seen, layers[0].due)]
    for p in [p for lay in layers for p in lay.parts]:
        for side in (p.k, p.v):
            out += [side.window, side.sink, side.window_valid, side.stored_valid, side.store.start, side.store.length,
                    list(side.store.starts), list(side.store.caps)]
            for t0, seg in side.store.iter_blocks():  # the stored rows (not the blocks' unwritten capacity)
                out += [t0, *(seg.tensors()[k] for k in sorted(seg.tensors()))]
    return out


def _same(a: list, b: list) -> bool:
    def eq(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x, y))
        return x == y

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("sink, quantize_after, batch", [(0, 0, 1), (3, 0, 2), (2, 70, 2)])
def test_split_layer_equals_one_plain_layer_per_group(dtype, sink, quantize_after, batch):
    """Every step of a split layer (the shared window written once for all heads) leaves every group exactly
    as a plain KiviLayer of that group's width fed that group's heads, and returns the same views, across
    key flushes, block boundaries, multi-token forwards, crops and reorders."""
    cfg = KiviConfig(**LAYER, sink_tokens=sink, quantize_after=quantize_after)
    split = HeadSplitLayer(cfg, K_BITS, V_BITS)
    plain = [KiviLayer(dataclasses.replace(cfg, k_bits=g.k_bits, v_bits=g.v_bits)) for g in split.groups]
    chunks = [29] + [1] * 45 + [7] + [1] * 30
    for i, (k, v) in enumerate(_inputs(chunks, dtype=dtype, batch=batch)):
        got = split.append(k, v)
        want = [p.append(k[:, g.start:g.stop].contiguous(), v[:, g.start:g.stop].contiguous())
                for g, p in zip(split.groups, plain)]
        for s in range(2):
            assert _same([materialize_heads(got[s], dtype)],
                         [torch.cat([materialize(w[s], dtype) for w in want], dim=1)])
        assert _same(_state(split), _state(plain)), f"forward {i}"
        assert split.memory_breakdown() == {k: sum(p.memory_breakdown()[k] for p in plain)
                                            for k in split.memory_breakdown()}
        if i == 60:
            for lay in (split, *plain):
                lay.crop(-5)
                lay.reorder_cache(torch.arange(batch).flip(0))
    assert split.nbytes == sum(p.nbytes for p in split.parts)


def test_decode_shares_one_window_and_counts_it_once():
    """After a decode step the groups' windows are head slices of one tensor that holds nothing else
    (the bytes reported are the bytes kept alive), and the next step reuses it without a copy."""
    layer = HeadSplitLayer(KiviConfig(**LAYER), K_BITS, V_BITS)
    for k, v in _inputs([40, 1, 1]):
        layer.append(k, v)
    for side in ("k", "v"):
        full = layer.window(side)
        windows = [getattr(p, side).window for p in layer.parts]
        assert full.shape[1] == layer.num_kv_heads and full.numel() == sum(w.numel() for w in windows)
        for g, w in zip(layer.groups, windows):
            assert w.data_ptr() == full[:, g.start:g.stop].data_ptr()  # a view, no copy
        assert layer.window(side) is full
    layer.parts[1].k.set_window(layer.parts[1].k.window.clone(), None)  # a group's window replaced
    assert layer.window("k") is not None and torch.equal(layer.window("k"), torch.cat(
        [p.k.window for p in layer.parts], dim=1))


def test_joint_decode_step_fails_whole(monkeypatch):
    """A group failing to store what leaves its window after the groups before it stored theirs: the step
    raises and every group is left as it was (stores, windows, counters)."""
    layer = HeadSplitLayer(KiviConfig(**LAYER), K_BITS, V_BITS)
    for k, v in _inputs([40] + [1] * 8):
        layer.append(k, v)
    before = _state(layer)
    calls = []

    def boom(x, valid):
        calls.append("token")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(layer.parts[2].v, "_store_moved", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        layer.append(*_inputs([1], seed=3)[0])
    assert calls == ["token"]  # groups 0 and 1 stored their value token first
    assert _same(_state(layer), before)
    monkeypatch.undo()
    layer.append(*_inputs([1], seed=3)[0])
    assert layer.seen == 49
