"""kivi.paged.ring: the one window-ring rule, and every place that follows it (both hosts' slots and row ids, the
compiled row-id kernel) agreeing with it on random positions, sinks and ring sizes.

The decode kernels' column rule (numba, torch reference) is checked against it in
``tests/attention/test_paged_decode.py`` (rings laid out by :func:`ring_slot`, random sinks / rings); the Triton
kernels' (``kivi/kernels/_paged_kernels.py``, ``_paged_inputs_kernels.py``) by the Triton tests under
``TRITON_INTERPRET=1`` where triton is installed.
"""

from __future__ import annotations

import random

import pytest
import torch

from kivi.batching.layout import build_layout
from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged.geometry import RingPool
from kivi.paged.ring import ring_slot, slot_place, slot_rows

CASES = [(ring, sink) for ring in (1, 2, 5, 16, 40) for sink in (0, 1, 3, 8)]


@pytest.mark.parametrize("ring, sink", CASES)
def test_ring_slot_keeps_sinks_and_never_reuses_a_slot_within_a_ring(ring, sink):
    """Positions below the sink keep their own slot; any ``ring`` consecutive later positions take distinct slots of
    ``[sink, sink + ring)``; the int and the tensor forms agree."""
    pos = torch.arange(0, sink + 5 * ring + 7)
    got = ring_slot(pos, ring, sink)
    assert got.tolist() == [ring_slot(int(p), ring, sink) for p in pos]
    assert got[:sink].tolist() == list(range(sink))
    later = got[sink:]
    assert ((later >= sink) & (later < sink + ring)).all()
    for first in range(sink, int(pos[-1]) - ring + 2):
        assert len(set(got[first: first + ring].tolist())) == ring, first
    assert (later == sink + pos[sink:] % ring).all()  # the formula the kernels restate


def test_slot_rows_is_the_block_and_row_of_slot_place():
    g = torch.Generator().manual_seed(0)
    for per_block in (7, 16, 5):
        blocks = torch.randperm(50, generator=g)[:9]
        slots = torch.randint(0, 9 * per_block, (3, 11), generator=g)
        ids = slot_rows(blocks, slots, per_block)
        index, row = slot_place(slots, per_block)
        assert torch.equal(ids, blocks[index] * per_block + row)
        assert ((row >= 0) & (row < per_block)).all() and torch.equal(index * per_block + row, slots)
        batched = slot_rows(blocks.expand(3, 9), slots, per_block)
        assert torch.equal(batched, slot_rows(blocks, slots, per_block))


@pytest.mark.parametrize("sink", [0, 3])
def test_batching_window_follows_the_rule(sink):
    """transformers' continuous batching keeps every layer's rings as the paged core does (ring ``k * Pw - S``,
    slot ``s`` in the request's window block ``s // Pw``, row ``s % Pw``), in unit ``layer`` of its blocks: the row of
    (block, layer, head, slot) is at byte ``block * block_bytes + layer * unit + (head * Pw + row) * 2D * item``."""
    from transformers import LlamaConfig

    model = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                        intermediate_size=32, vocab_size=32)
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, sink_tokens=sink)
    lay = build_layout(model, cfg, 16, torch.float32)
    pool = torch.zeros(7 * lay.block_bytes, dtype=torch.uint8)
    pw, item, d = lay.window_tokens, 4, lay.head_dim
    for layer, geo in enumerate(lay.geometries):
        assert geo.block_bytes == lay.unit and geo.window_tokens == pw and geo.sink_tokens == sink
        rings = lay.rings(pool, layer)
        for block, head, row in ((0, 0, 0), (3, 1, pw - 1), (6, 1, 2)):
            at = rings[block, head, row].data_ptr() - pool.data_ptr()
            assert at == block * lay.block_bytes + layer * lay.unit + (head * pw + row) * 2 * d * item
        blocks = list(range(40, 40 + geo.window_rings))
        random.Random(1).shuffle(blocks)
        for pos in range(200):
            j, row = slot_place(ring_slot(pos, geo.window_rings * pw - sink, sink), pw)
            assert j < lay.request_window_blocks(pos + 1) <= len(blocks) and row < pw


def test_vllm_rings_follow_the_rule():
    """The vLLM plugin: its ring slot is the rule with ring ``k * Pw - S`` (slot ``s`` in ring ``s // Pw``, row
    ``s % Pw``: :func:`slot_place` with one lane), its pool row ids are :func:`slot_rows` with one lane, on random
    rings, sinks and tables."""
    rng = random.Random(3)
    for _ in range(30):
        pw, k, sink = rng.randint(1, 9), rng.randint(1, 4), rng.randint(0, 6)
        if k * pw <= sink:
            continue
        n = rng.randint(1, 4)
        pos = torch.randint(0, 500, (n, 13))
        slot = ring_slot(pos, k * pw - sink, sink)
        assert ((slot >= 0) & (slot < k * pw)).all() and torch.equal(slot[pos < sink], pos[pos < sink])
        table = torch.stack([torch.randperm(30)[:k] for _ in range(n)]).to(torch.int32)
        ring, row = slot_place(slot, pw)
        assert torch.equal(ring * pw + row, slot) and (row < pw).all()
        base, step = torch.randint(0, 50, (k,)), torch.randint(1, 5, (k,))
        pool = RingPool({"k": torch.empty(1, pw, 1, 1)}, base, step)
        assert torch.equal(pool.slot_ids(table, slot), slot_rows(base + table.long() * step, slot, pw))


@pytest.mark.skipif(not numba_available(), reason="the compiled inputs kernel needs numba")
def test_compiled_row_ids_follow_the_rule():
    """kivi.paged.inputs_kernel (numba) restates :func:`slot_rows`: its row ids equal the rule's on random ring
    tables, bases, steps and slots."""
    import numpy as np

    from kivi.paged.inputs_kernel import kernel_inputs

    rng = np.random.default_rng(5)
    for pw, k, n, c in ((4, 3, 5, 11), (16, 1, 2, 16), (3, 5, 7, 15)):
        table = rng.integers(0, 40, (n + 2, k)).astype(np.int32)
        base, step = rng.integers(0, 60, k), rng.integers(1, 6, k)
        index = rng.permutation(n + 2)[:n].astype(np.int64)
        kslots, vslots = (rng.integers(0, k * pw, (n, c)) for _ in range(2))
        pages = rng.integers(0, 9, (n + 2, 3)).astype(np.int32)
        rows = np.zeros((n + 2, 2, 4), dtype=np.float32)
        out = [np.empty((n, c), np.int32), np.empty((n, c), np.int32), np.empty((n, 3), np.int32),
               np.empty((n, 2, 4), np.float32), np.empty((n, 2, 4), np.float32), np.empty((n, 2, 4), np.float32)]
        kernel_inputs(table, index, np.arange(n), base, step, kslots, vslots, pw, pages, rows, rows, rows, *out)
        blocks = torch.from_numpy(base) + torch.from_numpy(table[index]).long() * torch.from_numpy(step)
        for got, slots in ((out[0], kslots), (out[1], vslots)):
            assert torch.equal(torch.from_numpy(got).long(), slot_rows(blocks, torch.from_numpy(slots), pw))
