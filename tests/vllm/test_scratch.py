"""kivi.vllm.scratch: the scratch paged layout of a step's exact-prefill rows (no vLLM needed): every span's rows
land in its own blocks, in order, from a fresh block; the table and offsets say where; bad spans are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi.vllm.scratch import scratch_pages


@st.composite
def spans_and_block(draw):
    gaps = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    lens = draw(st.lists(st.integers(1, 40), min_size=len(gaps), max_size=len(gaps)))
    spans, at = [], 0
    for gap, n in zip(gaps, lens):
        spans.append((at + gap, at + gap + n))
        at += gap + n
    return spans, draw(st.sampled_from([1, 4, 16, 32])), draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(spans_and_block())
def test_rows_land_in_their_own_blocks_in_order(case):
    spans, block, spare = case
    s = scratch_pages(spans, block, "cpu", spare=spare)
    n_rows = spans[-1][1] + 2
    x = torch.arange(n_rows) * 10
    taken = s.take(x)
    assert taken.tolist() == [r * 10 for lo, hi in spans for r in range(lo, hi)]
    assert (s.rows is None) == all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    scratch = torch.full((s.num_blocks * block,), -1)
    scratch[s.slots] = taken
    assert s.query_start.tolist() == [0, *torch.tensor([hi - lo for lo, hi in spans]).cumsum(0).tolist()]
    assert s.seq_lens.tolist() == [hi - lo for lo, hi in spans] and s.max_len == max(s.seq_lens.tolist())
    assert s.table.dtype == s.query_start.dtype == s.seq_lens.dtype == torch.int32
    assert s.table.shape == (len(spans), max(-(-(hi - lo) // block) for lo, hi in spans) + spare)
    used = []
    for i, (lo, hi) in enumerate(spans):
        blocks = -(-(hi - lo) // block)
        ids = s.table[i, :blocks].tolist()
        assert (s.table[i, blocks:] == 0).all()
        read = torch.cat([scratch[b * block:(b + 1) * block] for b in ids])[: hi - lo]  # what a kernel reads
        assert read.tolist() == x[lo:hi].tolist()
        assert ids[0] == (used[-1] + 1 if used else 0)  # each request from a fresh block, blocks in order
        used.extend(ids)
    assert used == list(range(s.num_blocks))
    out = torch.full((n_rows,), -1.0)
    s.put(out, taken.float() + 0.5)
    inside = torch.zeros(n_rows, dtype=torch.bool)
    for lo, hi in spans:
        inside[lo:hi] = True
    assert (out[inside] == x[inside].float() + 0.5).all() and (out[~inside] == -1).all()


@pytest.mark.parametrize("spans, block, words", [
    ([], 16, "at least one span"), ([(0, 4)], 0, "block=0"), ([(3, 3)], 16, "each must hold a row"),
    ([(0, 5), (4, 8)], 16, "must not overlap"), ([(6, 9), (0, 2)], 16, "go backwards")])
def test_bad_spans_are_refused_by_name(spans, block, words):
    with pytest.raises(ValueError, match=words):
        scratch_pages(spans, block, "cpu")
