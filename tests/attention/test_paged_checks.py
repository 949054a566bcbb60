"""kivi.attention.fused_cpu.paged_checks: the compiled per-request input checks accept exactly what the numpy
checks (``paged._check_values``, the reference) accept, on random counts, block tables and slot tables near
every limit (negative counts, windows one past the ring, ids one outside the pool, keys not whole groups)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi.optional import numba_available

pytestmark = pytest.mark.skipif(not numba_available(), reason="the compiled checks need numba")


PERTURB = ["none", "negative", "totals", "partial-group", "block-id", "row-id-low", "row-id-high", "long-window",
           "big-sink", "narrow-table", "ragged-slots", "empty-window"]


@settings(max_examples=400, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), ring=st.booleans(), P=st.sampled_from([8, 16]), G=st.sampled_from([4, 8]),
       w0=st.integers(0, 3), nb=st.integers(1, 6), span=st.integers(1, 9), nrows=st.integers(1, 40),
       perturb=st.sampled_from(PERTURB))
def test_compiled_checks_accept_what_the_numpy_checks_accept(data, n, ring, P, G, w0, nb, span, nrows, perturb):
    """A valid batch (drawn at random), then at most one input pushed one past a limit."""
    from kivi.attention.fused_cpu.paged import RingRows, _check_values
    from kivi.attention.fused_cpu.paged_checks import values_ok

    cols = w0 + span  # ring: the slot table's columns (sink + ring); gathered: the fp slots
    limit = span + 1 if ring else span  # the longest window (ring: the new token and ring older ones)
    counts = []
    for _ in range(n):
        sink = data.draw(st.integers(0, w0))
        stored = data.draw(st.sampled_from([0, G, 2 * G]))
        window = data.draw(st.integers(1, limit))
        d = data.draw(st.integers(max(-stored, window - limit), window - 1))  # values: d more stored, d less window
        counts.append([sink, stored, window, sink, stored + d, window - d])
    slot_cols = [cols, cols]
    i = data.draw(st.integers(0, n - 1))
    row = counts[i]
    if perturb == "negative" and data.draw(st.booleans()):
        row[data.draw(st.integers(0, 5))] = -1
    elif perturb == "negative":  # a sink of -1, its side's total kept (its window one longer per token moved)
        s = 3 * data.draw(st.integers(0, 1))
        row[s + 2] += row[s] + 1
        row[s] = -1
    elif perturb == "totals":
        row[5] += 1
    elif perturb == "partial-group":
        row[1] += 1
        row[4] += 1
    elif perturb == "long-window":
        row[2] = limit + 1
        row[5] = row[0] + row[1] + row[2] - row[3] - row[4]
    elif perturb == "big-sink":  # one side's sink one past w0 (the token from its window)
        s = 3 * data.draw(st.integers(0, 1))
        row[s], row[s + 2] = w0 + 1, row[s + 2] - (w0 + 1 - row[s])
    elif perturb == "ragged-slots":
        slot_cols[1] += 1
    elif perturb == "empty-window" and data.draw(st.booleans()):  # the values' window moved to their stored
        row[5], row[4] = 0, row[4] + row[5]
    elif perturb == "empty-window":  # the keys' window replaced by one more stored group
        row[1], row[4], row[2] = row[1] + G, row[4] + G - row[2], 0
        if row[4] < 0:
            row[4], row[5] = 0, row[5] + row[4]
    pages = max((max(r[1], r[4]) + P - 1) // P for r in counts)
    width = max(pages, 1) + data.draw(st.integers(0, 1))
    table = [[data.draw(st.integers(0, nb - 1)) for _ in range(width)] for _ in range(n)]
    if perturb == "block-id" and max(row[1], row[4]) > 0:
        table[i][data.draw(st.integers(0, (max(row[1], row[4]) - 1) // P))] = data.draw(st.sampled_from([-1, nb]))
    elif perturb == "narrow-table":
        width = max(pages - 1, 0)
        table = [r[:width] for r in table]
    c = torch.tensor(counts, dtype=torch.int64)
    table = torch.tensor(table, dtype=torch.int32).view(n, width)
    layout = SimpleNamespace(page_size=P, group_size=G, block_bytes=4)
    pool = torch.empty(nb * 4, dtype=torch.uint8)
    if ring:
        fps = []
        bad_side = data.draw(st.integers(0, 1))
        for side in range(2):
            ids = torch.tensor([[data.draw(st.integers(0, nrows - 1)) for _ in range(slot_cols[side])]
                                for _ in range(n)], dtype=torch.int32).view(n, slot_cols[side])
            if perturb.startswith("row-id") and side == bad_side:
                ids[i, data.draw(st.integers(0, slot_cols[side] - 1))] = -1 if perturb == "row-id-low" else nrows
            fps.append(RingRows(torch.empty(nrows, 1, 1, 1), ids, torch.empty(n, 1, 1)))
        k_fp, v_fp = fps
        args = [k_fp.slots.numpy(), v_fp.slots.numpy(), nrows, nrows, True, 0]
    else:
        k_fp = torch.empty(n, cols, 1, 1)
        v_fp = torch.empty(n, cols + (1 if perturb == "ragged-slots" else 0), 1, 1)
        empty = torch.zeros(0, 0, dtype=torch.int32).numpy()
        args = [empty, empty, 0, 0, False, min(k_fp.shape[1], v_fp.shape[1])]
    try:
        _check_values(pool, layout, table, c, k_fp, v_fp, w0)
        want = True
    except ValueError:
        want = False
    if perturb == "none":
        assert want, "the unperturbed batch must be valid"
    assert values_ok(c.numpy(), table.numpy(), *args, w0, P, G, nb) == want


def test_both_outcomes_are_reached():
    """The random inputs above are near the limits, so both answers must come up (a test that cannot fail
    otherwise)."""
    from kivi.attention.fused_cpu.paged_checks import values_ok

    c = torch.tensor([[1, 8, 3, 1, 8, 3]]).numpy()
    table = torch.tensor([[2]], dtype=torch.int32).numpy()
    slots = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32).numpy()
    assert values_ok(c, table, slots, slots, 5, 5, True, 0, 1, 8, 8, 3)
    assert not values_ok(c, table, slots, slots, 4, 5, True, 0, 1, 8, 8, 3)  # row id 4 of 4 rows
    assert not values_ok(c, table, slots, slots, 5, 5, True, 0, 1, 8, 8, 2)  # block 2 of 2
    assert not values_ok(c, table, slots, slots, 5, 5, True, 0, 1, 8, 16, 3)  # 8 stored keys, groups of 16
