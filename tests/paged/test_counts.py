"""kivi.paged.counts: a paged request's sink / stored / window counts from its token count equal what moving its
tokens forward by forward (:func:`kivi.cache.schedule.window_exits`, the rule a layer applies) leaves, whatever the
chunking, with and without a shared prefix of the sink and whole pages taken quantized."""

from __future__ import annotations

import random

import pytest

from kivi.cache.schedule import window_exits
from kivi.config import KiviConfig
from kivi.paged.counts import kernel_counts, side_counts
from kivi.quant.page import AXIS, SIDES


def _walk(cfg, side, chunks, shared):
    """``(seen, sink, stored)`` after every forward of ``chunks`` tokens, moved forward by forward from ``shared``
    prefix tokens held as sink and pages (the stateful bookkeeping the function replaces)."""
    S = cfg.sink_tokens
    seen, sink, stored = shared, (S if shared else 0), (shared - S if shared else 0)
    out = [(seen, sink, stored)]
    for q in chunks:
        take, move = window_exits(AXIS[side], seen + q - sink - stored, cfg.residual_length, cfg.group_size, sink, S,
                                  sink + stored, cfg.quantize_after)
        seen, sink, stored = seen + q, sink + take, stored + move
        out.append((seen, sink, stored))
    return out


@pytest.mark.parametrize("R, G, S", [(8, 8, 0), (16, 8, 3), (0, 4, 0), (32, 32, 4), (12, 4, 2)])
def test_counts_follow_the_token_count_with_any_chunking_and_shared_prefix(R, G, S):
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=G, residual_length=R, sink_tokens=S)
    rng = random.Random(R * 100 + G * 10 + S)
    P = 2 * G  # shared prefixes: the sink and whole pages of P tokens (G divides P)
    for trial in range(40):
        shared = S + P * rng.randint(1, 4) if trial % 2 else 0
        chunks = [rng.choice([1, 1, 1, 2, 7, 30]) for _ in range(rng.randint(1, 25))]
        for side in SIDES:
            for seen, sink, stored in _walk(cfg, side, chunks, shared):
                assert side_counts(cfg, side, seen, shared) == (sink, stored, seen - sink - stored), (
                    side, shared, chunks, seen)


def test_kernel_counts_are_both_sides_with_the_new_token():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, sink_tokens=3)
    for past in (0, 5, 19, 40, 121):
        for shared in (0, 3 + 16):
            row = kernel_counts(cfg, past, shared if shared <= past else 0)
            n = shared if shared <= past else 0
            want = [c + (i == 2) for side in SIDES for i, c in enumerate(side_counts(cfg, side, past, n))]
            assert row == want
