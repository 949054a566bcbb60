"""kivi.cache.schedule: the cache's token arithmetic, and that KiviLayer / BlockStore follow it."""

from __future__ import annotations

import random

import pytest
import torch

from kivi.cache.layer import KiviLayer
from kivi.cache.schedule import (
    KEY_AXIS,
    VALUE_AXIS,
    allocated_tokens,
    first_block_tokens,
    flush_count,
    freed_tokens,
    key_group_start,
    layer_sink_tokens,
    query_tier_ranges,
    side_tokens,
    sink_take,
    sliding_cut,
    window_capacity,
    window_ring_slots,
)
from kivi.cache.sliding import new_layer
from kivi.cache.store import BlockStore, FpSegment
from kivi.config import KiviConfig

# --------------------------------------------------------------------------- the rules, by example


def test_sliding_layers_keep_no_sink():
    assert layer_sink_tokens(4, None) == 4
    assert layer_sink_tokens(4, 64) == 0
    assert layer_sink_tokens(0, None) == 0


def test_sink_takes_the_first_tokens_to_leave_the_window():
    assert sink_take(pending=100, residual_length=128, sink_len=0, sink_tokens=4) == 0  # nothing leaves
    assert sink_take(130, 128, 0, 4) == 2  # only 2 tokens have R newer ones
    assert sink_take(300, 128, 0, 4) == 4
    assert sink_take(300, 128, 3, 4) == 1  # tops the sink up
    assert sink_take(300, 128, 4, 4) == 0  # full
    assert sink_take(300, 128, 0, 0) == 0  # no sink


def test_keys_leave_in_whole_groups_values_beyond_r():
    assert flush_count(KEY_AXIS, 128 + 31, 128, 32) == 0  # R newer keys must remain after a whole group
    assert flush_count(KEY_AXIS, 128 + 32, 128, 32) == 32
    assert flush_count(KEY_AXIS, 128 + 95, 128, 32) == 64
    assert flush_count(VALUE_AXIS, 128 + 31, 128, 32) == 31
    assert flush_count(VALUE_AXIS, 100, 128, 32) == 0
    assert flush_count(KEY_AXIS, 33, 0, 32) == 32  # R = 0
    with pytest.raises(ValueError, match="axis"):
        flush_count("keys", 10, 0, 32)


@pytest.mark.parametrize("axis", [KEY_AXIS, VALUE_AXIS])
def test_side_tokens_partition_and_unquantized(axis):
    for seen in range(0, 400, 7):
        s, stored, window = side_tokens(axis, seen, 64, 32, sink_tokens=4)
        assert s + stored + window == seen and s <= 4
        assert window <= (64 + 31 if axis == KEY_AXIS else 64)
        if axis == KEY_AXIS:
            assert stored % 32 == 0
    assert side_tokens(axis, 1000, 64, 32, 4, quantized=False) == (0, 1000, 0)


def test_key_window_is_r_plus_remainder():
    # seen = 1000, R = 128, G = 32: keys keep R + (T - R) mod G, values keep R
    assert side_tokens(KEY_AXIS, 1000, 128, 32) == (0, 864, 136)
    assert side_tokens(VALUE_AXIS, 1000, 128, 32) == (0, 872, 128)
    assert side_tokens(KEY_AXIS, 1000, 128, 32, sink_tokens=4) == (4, 864, 132)


@pytest.mark.parametrize("R,G,sink", [(128, 32, 0), (32, 16, 4), (0, 32, 0), (32, 32, 40), (16, 8, 2)])
def test_window_capacity_is_the_largest_window_and_the_ring_holds_a_step(R, G, sink):
    """Between forwards a window holds at most window_capacity tokens (keys reach it, values stay at R); a
    decode step reads that window and its new token, so a ring of window_ring_slots never reuses a slot the
    step reads: the window's positions and the new one are distinct modulo the ring."""
    most = {axis: max(side_tokens(axis, seen, R, G, sink)[2] for seen in range(1, 600)) for axis in (KEY_AXIS,
                                                                                                    VALUE_AXIS)}
    assert most[KEY_AXIS] == window_capacity(R, G) and most[VALUE_AXIS] <= window_capacity(R, G)
    ring = window_ring_slots(R, G)
    for seen in range(1, 600):
        for axis in (KEY_AXIS, VALUE_AXIS):
            _, _, window = side_tokens(axis, seen, R, G, sink)
            assert len({t % ring for t in range(seen - window, seen + 1)}) == window + 1


@pytest.mark.parametrize("axis", [KEY_AXIS, VALUE_AXIS])
@pytest.mark.parametrize("R,G,sink", [(128, 32, 0), (32, 16, 4), (0, 32, 0), (32, 32, 40)])
def test_state_does_not_depend_on_chunking(axis, R, G, sink):
    """Flushing chunk by chunk with sink_take / flush_count ends where side_tokens says."""
    rng = random.Random(R + G + sink)
    for _ in range(30):
        s = stored = window = seen = 0
        while seen < 600:
            n = rng.choice([1, 1, 1, rng.randint(1, 200)])
            seen += n
            pending = window + n
            t = sink_take(pending, R, s, sink)
            s, pending = s + t, pending - t
            m = flush_count(axis, pending, R, G)
            stored, window = stored + m, pending - m
            assert (s, stored, window) == side_tokens(axis, seen, R, G, sink)


def test_key_group_start_is_aligned_after_the_sink():
    assert key_group_start(100, 0, 32) == 96
    assert key_group_start(99, 4, 32) == 68  # groups [4, 36), [36, 68), [68, 100)
    assert key_group_start(100, 4, 32) == 100


def test_sliding_cut():
    # W = 64, R = 32, G = 32, block 64: nothing is cut before W + R + G + block tokens
    assert sliding_cut(191, 64, 32, 32, 64) == 0
    assert sliding_cut(192, 64, 32, 32, 64) == 64
    assert sliding_cut(255, 64, 32, 32, 64) == 64
    assert sliding_cut(256, 64, 32, 32, 64) == 128
    assert sliding_cut(0, 64, 32, 32, 64) == 0


def test_block_allocation_numbers():
    assert first_block_tokens(0, 256) == 256
    assert first_block_tokens(1000, 256) == 1000  # a long prefill: one exact-size block
    assert allocated_tokens(0, 0, 256) == 0
    assert allocated_tokens(160, 160, 256) == 256
    assert allocated_tokens(1000, 1000, 256) == 1000
    assert allocated_tokens(1001, 1000, 256) == 1256
    assert allocated_tokens(1513, 1000, 256) == 1512 + 256
    assert freed_tokens(999, 1000, 256) == 0
    assert freed_tokens(1000, 1000, 256) == 1000
    assert freed_tokens(1300, 1000, 256) == 1256


# --------------------------------------------------------------------------- the cache follows them


def _kv(t, d=8, b=1, h=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


@pytest.mark.parametrize("cfg,window", [
    (KiviConfig(group_size=8, residual_length=16, block_size=32), None),
    (KiviConfig(group_size=8, residual_length=16, block_size=32, sink_tokens=3), None),
    (KiviConfig(group_size=8, residual_length=0, block_size=16, sink_tokens=5), None),
    (KiviConfig(group_size=8, residual_length=16, block_size=32, sink_tokens=3), 24),
])
def test_kivilayer_state_matches_the_schedule(cfg, window):
    layer = new_layer(cfg, window)
    assert layer.sink_tokens == layer_sink_tokens(cfg.sink_tokens, window)
    k, v = _kv(400)
    rng = random.Random(1)
    seen = 0
    while seen < 400:
        n = min(400 - seen, rng.choice([1, 1, 2, rng.randint(1, 60)]))
        layer.append(k[:, :, seen : seen + n], v[:, :, seen : seen + n])
        seen += n
        for side, axis in ((layer.k, KEY_AXIS), (layer.v, VALUE_AXIS)):
            s, stored, win = side_tokens(axis, seen, cfg.residual_length, cfg.group_size, layer.sink_tokens)
            assert (side.sink_len, side.store.length - side.sink_len, side.window_len) == (s, stored, win)
        if window is not None:
            assert layer.kv_offset == sliding_cut(seen, window, cfg.residual_length, cfg.group_size, cfg.block_size)


@pytest.mark.parametrize(
    "first,later,step,bs", [(0, 300, 1, 64), (40, 300, 1, 64), (100, 700, 8, 64), (1000, 1100, 1, 256)]
)
def test_blockstore_allocates_as_the_schedule_says(first, later, step, bs):
    store = BlockStore(bs)
    x = torch.zeros(1, 1, max(first, step), 2)
    store.append(FpSegment(x[:, :, :first] if first else x[:, :, :step]))
    written = first or step
    while written < later:
        store.append(FpSegment(x[:, :, :step]))
        written += step
        assert sum(store.caps) == allocated_tokens(written, first, bs)
    for start in range(0, written, 37):
        store.evict(start)
        freed = sum(c for blk, c in zip(store.blocks, store.caps) if blk is None)
        assert freed == freed_tokens(start, first, bs)



TIERS4 = dict(k_bits=8, v_bits=4, group_size=16, residual_length=16, block_size=32, sink_tokens=3,
              tiers=[(16, None), (32, (8, 4)), (64, (4, 2)), (None, (2, 1))])


@pytest.mark.parametrize("axis,side", [("channel", "k"), ("token", "v")])
@pytest.mark.parametrize("P,n,exact", [(150, 9, 0), (5, 140, 0), (0, 70, 61)], ids=["verify", "long", "prompt"])
def test_query_tier_ranges_are_the_tiers_of_one_token_decoding(axis, side, P, n, exact):
    """Query i of a forward of n tokens after P: the tier ranges a layer holds after P + i tokens (the state
    depends on the count alone); the first ``exact`` queries (a prefill's prompt) see the tiers before it."""
    cfg = KiviConfig(**TIERS4)
    x = torch.randn(1, 1, P + n, 16)
    before = KiviLayer(cfg)
    if P:
        before.append(x[:, :, :P], x[:, :, :P])
    s = getattr(before, side)
    keeps = tuple(t for t, _ in cfg.tiers[1:-1])
    ranges = query_tier_ranges(axis, s.window_len, n, 16, 16, s.sink_len, 3, s.store.length - s.sink_len, keeps,
                               exact=exact)
    for i in range(n):
        seen = P + (i if i >= exact else 0)
        layer = KiviLayer(cfg)
        if seen:
            layer.append(x[:, :, :seen], x[:, :, :seen])
        chain = list(reversed(getattr(layer, side).chain))  # newest tier first
        want = [(st.start - s.store.length, st.length - s.store.length) for st in chain]
        assert [hi - lo for lo, hi in ranges[i]] == [hi - lo for lo, hi in want], i
        assert [r for r in ranges[i] if r[1] > r[0]] == [r for r in want if r[1] > r[0]], i
