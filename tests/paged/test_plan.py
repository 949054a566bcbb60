"""kivi.paged.plan and the ring pool: a step's layer-independent schedule against the schedule's own rules, and
row ids that name the rows the rings hold (no vLLM needed).

The plan is checked position by position against :func:`kivi.cache.schedule.side_tokens` /
:func:`~kivi.cache.schedule.window_exits` and :func:`kivi.paged.ring.ring_slot` on batches mixing
prefills, chunks, decode rows with nothing stored yet and decode rows whose sink is still filling; the ring
pool's row ids are checked against the ring tensors themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kivi.cache.schedule import side_tokens, window_exits
from kivi.config import KiviConfig
from kivi.paged.geometry import build_geometry, ring_pool
from kivi.paged.plan import step_plan, stores_any
from kivi.paged.ring import ring_slot
from kivi.quant.page import AXIS, SIDES

H, D, P = 2, 16, 16

CONFIGS = [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16),
           KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, sink_tokens=5),
           KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=16, sink_tokens=1)]


def batch_of(rows):
    """rows: [(past, q_len)] -> (query_start, seq_lens)."""
    qs = [0]
    for _, q in rows:
        qs.append(qs[-1] + q)
    return qs, [p + q for p, q in rows]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["G8-R16", "G8-R8-S5", "G16-R16-S1"])
def test_plan_follows_the_schedule(cfg):
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    R, G, S = cfg.residual_length, cfg.group_size, cfg.sink_tokens
    slots = geo.window_rings * geo.window_tokens
    ring = slots - S
    # every past from 0 to past several window wraps, as decode rows; a prefill, a chunk and an idle row
    rows = [(p, 1) for p in range(0, 3 * slots + 2 * G)] + [(0, 37), (23, 9), (40, 0)]
    qs, seqs = batch_of(rows)
    plan = step_plan(cfg, geo, qs, seqs)
    assert plan.fits(geo)
    kernel = plan.kernel
    want_kernel = [i for i, (p, q) in enumerate(rows) if q == 1 and stores_any(cfg, p)]
    assert kernel.rows == want_kernel and kernel.w0 == S
    assert sorted(plan.others + kernel.rows) == [i for i, (_, q) in enumerate(rows) if q]
    assert kernel.tokens.tolist() == [qs[i] for i in kernel.rows]
    spans = {side: [] for side in SIDES}
    for j, i in enumerate(kernel.rows):
        past = rows[i][0]
        for s, side in enumerate(SIDES):
            sink, stored, window = side_tokens(AXIS[side], past, R, G, S)
            assert kernel.counts[j, 3 * s: 3 * s + 3].tolist() == [sink, stored, window + 1]
            cols = kernel.slots[side][j]
            assert cols.shape[0] == S + ring
            assert cols.tolist() == list(range(slots))  # the kernel's column is the slot (kivi.paged.ring)
            for t in range(sink + stored, past):  # the window's earlier tokens: at their ring slot, no clash
                assert ring_slot(t, slots - S, S) == (t if t < S else S + t % ring), (past, side, t)
            assert len({ring_slot(t, slots - S, S) for t in range(sink + stored, past)}) == past - sink - stored
            take, move = window_exits(AXIS[side], window + 1, R, G, sink, S)
            if move:
                spans[side].append((j, i, sink + stored + take, move, stored))
    for side in SIDES:
        gone = kernel.leaving[side]
        if not spans[side]:
            assert gone is None
            continue
        assert gone.spans == [(i, stored, move) for _, i, _, move, stored in spans[side]]
        want_row = [j for j, _, _, move, _ in spans[side] for _ in range(move)]
        want_pos = [first + c for _, _, first, move, _ in spans[side] for c in range(move)]
        assert gone.row.tolist() == want_row
        assert gone.slot.tolist() == [ring_slot(p, slots - S, S) for p in want_pos]
        assert gone.new.tolist() == [p == rows[kernel.rows[j]][0] for j, p in zip(want_row, want_pos)]
        # the compiled writes' table: (request, ring slot or -1, input row of a new token or -1, store position)
        want_table = [(kernel.rows[j], -1 if new else ring_slot(p, slots - S, S), qs[kernel.rows[j]] if new else -1, u)
                      for (j, p, new, u) in zip(want_row, want_pos, gone.new.tolist(),
                                                [stored + c for _, _, _, move, stored in spans[side]
                                                 for c in range(move)])]
        assert gone.table.dtype == np.int64 and [tuple(r) for r in gone.table.tolist()] == want_table
    assert spans["v"], "values must leave some kernel row's window"


@pytest.mark.parametrize("cfg", CONFIGS, ids=["G8-R16", "G8-R8-S5", "G16-R16-S1"])
def test_ring_writes_are_the_tokens_kept_in_full_precision(cfg):
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    S, keep = cfg.sink_tokens, geo.sliding_window - 1
    slots, pw = geo.window_rings * geo.window_tokens, geo.window_tokens
    rows = [(0, 3), (0, 70), (12, 1), (40, 25), (2, 1), (99, 1), (7, 0)]
    qs, seqs = batch_of(rows)
    w = step_plan(cfg, geo, qs, seqs).writes
    got = sorted(zip(w.req.tolist(), w.slot.tolist(), w.src.tolist()))
    assert w.table.dtype == np.int64 and w.table.tolist() == [list(r) for r in zip(w.req.tolist(), w.slot.tolist(),
                                                                                    w.src.tolist())]
    want = sorted((i, ring_slot(p, slots - S, S), qs[i] + p - past) for i, (past, q) in enumerate(rows)
                  for p in range(past, past + q) if p < S or p >= past + q - keep)
    assert got == want
    ring = (w.slot // pw).tolist()
    assert ring == sorted(ring), "sorted by ring"
    covered = []
    for r, lo, hi in w.bounds:
        assert set(ring[lo:hi]) == {r}
        covered += list(range(lo, hi))
    assert covered == list(range(len(ring)))


def test_plan_moves_to_the_steps_device_whole():
    """On a GPU the builder moves the step's plan to the device once (KiviMetadataBuilder.build): every tensor of
    it, at any depth ("meta" stands for the device here), and nothing else changes."""
    cfg = CONFIGS[1]
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    rows = [(p, 1) for p in range(0, 60, 3)] + [(0, 37), (23, 9)]
    plan = step_plan(cfg, geo, *batch_of(rows))
    assert plan.kernel.leaving["k"] is not None and plan.writes is not None, "the plan must have every part"
    moved = plan.to("meta")
    seen = []

    def walk(a, b, path):
        if isinstance(a, torch.Tensor):
            assert b.device.type == "meta" and b.shape == a.shape and b.dtype == a.dtype, path
            seen.append(path)
        elif isinstance(a, np.ndarray):
            assert b is a, path
        elif hasattr(a, "__dataclass_fields__"):
            for name in a.__dataclass_fields__:
                walk(getattr(a, name), getattr(b, name), f"{path}.{name}")
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), path
            for k in a:
                walk(a[k], b[k], f"{path}[{k}]")
        else:
            assert a == b, path

    walk(plan, moved, "plan")
    assert "plan.kernel.slots[k]" in seen and "plan.kernel.leaving[v].slot" in seen and "plan.writes.src" in seen


def test_no_decode_rows_no_kernel():
    cfg = CONFIGS[0]
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    plan = step_plan(cfg, geo, *batch_of([(0, 30), (3, 1)]))  # a prefill, and a decode row storing nothing
    assert plan.kernel is None and plan.others == [0, 1]
    other = build_geometry(CONFIGS[1], page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    assert not plan.fits(other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_pool_ids_name_the_rings_rows(dtype):
    cfg = CONFIGS[1]
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype)
    k, pw, nb = geo.window_rings, geo.window_tokens, 9
    unit = geo.block_bytes // dtype.itemsize
    buf = torch.randn(nb * (k + 1) * unit + 3).to(dtype)
    # block-outermost packing with one other layer's block in between, ring r at (b * (k + 1) + r + 1) units
    rings = [buf.as_strided((nb, H, pw, 2 * D), ((k + 1) * unit, pw * 2 * D, 2 * D, 1), (r + 1) * unit)
             for r in range(k)]
    pool = ring_pool(rings, geo)
    assert pool is not None
    table = torch.randint(0, nb, (4, k))
    slot = torch.arange(k * pw).expand(4, -1)
    ids = pool.slot_ids(table, slot)
    for i in range(4):
        for s in range(k * pw):
            r, row = divmod(s, pw)
            block, at = divmod(int(ids[i, s]), pw)
            for side, cols in (("k", slice(0, D)), ("v", slice(D, 2 * D))):
                assert torch.equal(pool.rows[side][block, at], rings[r][table[i, r], :, row, cols])
    assert ring_pool([r.clone() for r in rings], geo) is None  # separate allocations
