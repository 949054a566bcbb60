"""kivi.paged.step: one layer's paged step, driven by a small host, equals one-sequence KiviLayer.

The host here is the least a paged host maps onto the step: pages in one byte pool (``page_fields`` /
``field_view``), a block table per request drawn from a shuffled free list, and each request's full-precision rows
in its own slots (:func:`kivi.paged.ring.ring_slot`; unwritten slots are NaN, so a read of one poisons the view).
Requests of random lengths (not multiples of ``G``) go through prefills, chunks and decode steps in mixed
batches; each step's views (sink, stored tokens, full-precision rows, per-query boundary) and, at the end, the
pages must equal what :class:`kivi.cache.KiviLayer` holds for each request alone. A NaN among one request's
leaving values raises and leaves pages and rows as they were.
"""

from __future__ import annotations

import pytest
import torch

from kivi.cache.layer import KiviLayer
from kivi.cache.pages import page_store, store_rows
from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged.counts import side_counts
from kivi.paged.ring import ring_slot
from kivi.paged.step import (
    Leaving,
    Pages,
    Pending,
    commit,
    exits,
    page_index,
    quantize_leaving,
    request_view,
)
from kivi.quant.page import SIDES, field_view, page_fields

H, D, P = 2, 16, 16

CONFIGS = [
    KiviConfig(k_bits=2, v_bits=2, group_size=4, residual_length=8, block_size=16),
    KiviConfig(k_bits=4, v_bits=2, group_size=4, residual_length=12, block_size=16, sink_tokens=3),
    KiviConfig(k_bits=2, v_bits=4, group_size=8, residual_length=0, block_size=16, sink_tokens=5),
]
IDS = ["K2V2-R8", "K4V2-R12-S3", "K2V4-R0-S5"]
DTYPES = [torch.float32, torch.bfloat16]



def kept_rows(past: int, q: int, sink_slots: int, kept: int) -> list[tuple[int, int]]:
    """The fake host's rows to write (a ring of ``R + G`` slots, written before the reads): the position ranges of
    a step's ``q`` new tokens (``[past, past + q)``) that keep a full-precision row: those below the sink slots and
    those still in the window after the step (from ``kept`` on: sink + stored + take + move)."""
    end = past + q
    below = min(end, max(past, sink_slots))
    return [(a, b) for a, b in ((past, below), (max(kept, below), end)) if b > a]


class Host:
    """A paged host in a few lines: pages, block tables, full-precision slots; :meth:`step` maps them onto
    :mod:`kivi.paged.step`."""

    def __init__(self, cfg: KiviConfig, dtype: torch.dtype, nblocks: int = 96, seed: int = 0):
        self.cfg, self.dtype = cfg, dtype
        fields, block_bytes = page_fields(cfg, H, D, P, dtype)
        self.mem = torch.zeros(nblocks * block_bytes, dtype=torch.uint8)
        self.views = {side: {f.name: field_view(self.mem, f.shape, f.dtype, f.offset, block_bytes)
                             for f in fields if f.side == side} for side in SIDES}
        self.per_row = {side: {f.name: f.tokens_per_row for f in fields if f.side == side} for side in SIDES}
        self.free = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.ring = cfg.residual_length + cfg.group_size  # the window after a step: at most R + G - 1 tokens
        self.tables: dict[int, list[int]] = {}
        self.rows: dict[int, torch.Tensor] = {}  # [2, H, S + ring, D] per request
        self.seen: dict[int, int] = {}

    def store(self, rid: int, side: str, sink: int, stored: int):
        return page_store(self.views[side], self.tables[rid][: -(-stored // P)], sink, stored, P,
                          fmt=self.cfg.side_format(side), head_dim=D)

    def step(self, batch: list[tuple[int, torch.Tensor, torch.Tensor]]) -> dict:
        """One step of ``(request, keys [H, q, D], values [H, q, D])``; the views attention reads, per request
        and side."""
        cfg, S = self.cfg, self.cfg.sink_tokens
        for rid, k, _ in batch:
            if rid not in self.seen:
                self.seen[rid], self.tables[rid] = 0, []
                self.rows[rid] = torch.full((2, H, S + self.ring, D), float("nan"), dtype=self.dtype)
            need = max(side_counts(cfg, side, self.seen[rid] + k.shape[1])[1] for side in SIDES)
            while len(self.tables[rid]) * P < need:
                self.tables[rid].append(self.free.pop())
        width = max(len(self.tables[rid]) for rid, _, _ in batch)
        table = torch.tensor([self.tables[rid] + [0] * (width - len(self.tables[rid])) for rid, _, _ in batch],
                             dtype=torch.long).reshape(len(batch), width)
        views, sides, writes = {}, [], []
        for s, side in enumerate(SIDES):
            leaving = Leaving(cfg, side)
            for j, (rid, *new) in enumerate(batch):
                new, past = new[s], self.seen[rid]
                q = new.shape[1]
                sink, stored, _ = side_counts(cfg, side, past)
                take, move = exits(cfg, side, past, q, sink, stored)
                rows = self.rows[rid][s]
                old = rows[:, ring_slot(torch.arange(sink + stored, past), self.ring, S)]
                pending = Pending(cfg, side, torch.cat([old, new], dim=1), take, move)
                views[rid, side] = request_view(cfg, side, pending, self.store(rid, side, sink, stored),
                                                rows[:, :sink] if sink else None, q, past)
                if move:
                    leaving.add(pending, [(j, stored, move)])
                for a, b in kept_rows(past, q, S, sink + stored + take + move):
                    writes.append((rows, ring_slot(torch.arange(a, b), self.ring, S), new[:, a - past: b - past]))
            sides.append((leaving, Pages(self.views[side], self.per_row[side], table, P)))

        def write_rows():
            for rows, slots, x in writes:
                rows[:, slots] = x

        commit(sides, write_rows)
        for rid, k, _ in batch:
            self.seen[rid] += k.shape[1]
        return views


def same_segment(a, b, what):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys(), what
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{what}: field {name}"


def same_view(ours, ref, what):
    """Bit for bit what attention reads: split, sink, stored tokens, full-precision rows, per-query boundary."""
    assert ours.split == ref.split, what
    sink = 0 if ref.sink is None else ref.sink.shape[-2]
    assert (0 if ours.sink is None else ours.sink.shape[-2]) == sink, what
    if sink:
        assert torch.equal(ours.sink, ref.sink), f"{what}: sink"
    assert torch.equal(ours.fp, ref.fp), f"{what}: full-precision rows"
    if ref.split > sink:
        same_segment(ours.store.read_range(sink, ref.split), ref.store.read_range(sink, ref.split), f"{what}: stored")
    assert (ours.region is None) == (ref.region is None), f"{what}: per-query boundary"
    if ref.region is not None:
        r, o = ref.region, ours.region
        assert (o.first, o.exact, len(o.versions)) == (r.first, r.exact, len(r.versions)), what
        assert torch.equal(o.choice, r.choice), f"{what}: boundary"
        for x, y in zip(o.versions, r.versions):
            assert torch.equal(x, y), f"{what}: boundary versions"


def schedule(seed: int, requests: int = 4, steps: int = 14) -> list[list[tuple[int, int]]]:
    """Batches of ``(request, q)``: prompts of random lengths (some arriving late), then chunks and decode rows."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    arrive = [rand(0, 4) for _ in range(requests)]
    out = []
    for t in range(steps):
        batch = []
        for rid in range(requests):
            if t < arrive[rid]:
                continue
            if t == arrive[rid]:
                batch.append((rid, rand(1, 40)))  # a prompt (or its first chunk)
            else:
                batch.append((rid, 1 if rand(0, 3) else rand(2, 13)))  # a decode row or a chunk
        out.append(batch)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_step_equals_one_sequence_kivi_layer(cfg, dtype, seed):
    host = Host(cfg, dtype, seed=seed)
    layers: dict[int, KiviLayer] = {}
    g = torch.Generator().manual_seed(100 + seed)
    for t, plan in enumerate(schedule(seed)):
        batch = [(rid, *(torch.randn(H, q, D, generator=g).to(dtype) for _ in SIDES)) for rid, q in plan]
        views = host.step(batch)
        for rid, k, v in batch:
            layer = layers.setdefault(rid, KiviLayer(cfg))
            ref = layer.append(k.unsqueeze(0), v.unsqueeze(0))
            for side, r in zip(SIDES, ref):
                same_view(views[rid, side], r, f"step {t}, request {rid}, side {side}")
    for rid, layer in layers.items():  # what the pages hold at the end: the one-sequence store's codes
        for side in SIDES:
            st = getattr(layer, side)
            sink, stored, _ = side_counts(cfg, side, host.seen[rid])
            assert (st.sink_len, st.store.length) == (sink, sink + stored)
            if stored:
                same_segment(host.store(rid, side, sink, stored).read_range(sink, sink + stored),
                             st.store.read_range(sink, sink + stored), f"request {rid} side {side} pages")


def test_a_refused_value_writes_nothing():
    """Decode steps of four requests (their key groups leave at different steps); a NaN among one request's values
    is refused when it leaves the window: the step raises and every page byte and full-precision row is as it was,
    keys included (quantized before anything is written)."""
    cfg = CONFIGS[0]
    host = Host(cfg, torch.float32)
    g = torch.Generator().manual_seed(7)
    host.step([(rid, *(torch.randn(H, n, D, generator=g) for _ in SIDES)) for rid, n in enumerate((30, 13, 31, 32))])
    poisoned = False
    for t in range(3 * cfg.residual_length):
        batch = [(rid, *(torch.randn(H, 1, D, generator=g) for _ in SIDES)) for rid in range(4)]
        if not poisoned:
            batch[1][2][0, 0, 3] = float("nan")  # request 1's value, in its window for R steps
            poisoned = True
        keys_due = sum(exits(cfg, "k", host.seen[rid], 1, *side_counts(cfg, "k", host.seen[rid])[:2])[1]
                       for rid in range(4))
        mem, rows = host.mem.clone(), {rid: r.clone() for rid, r in host.rows.items()}
        seen = dict(host.seen)
        try:
            host.step(batch)
        except ValueError as e:
            assert "NaN" in str(e)
            assert keys_due, "no key left any window in the refused step: the test would not see a partial write"
            assert torch.equal(host.mem, mem), "a refused step wrote the pages"
            for rid, r in rows.items():
                assert torch.equal(host.rows[rid].nan_to_num(7.0), r.nan_to_num(7.0)), f"request {rid}'s rows"
            assert host.seen == seen
            assert t == cfg.residual_length, f"refused at step {t}"
            return
    pytest.fail("the NaN value left the window without an error")


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_quantize_leaving_fast_path_equals_reference(cfg, dtype):
    x = torch.randn(H, 19, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    same_segment(quantize_leaving(cfg, "v", x), quantize_leaving(cfg, "v", x, compiled=False), "values")
    keys = x[:, :16]  # whole key groups
    same_segment(quantize_leaving(cfg, "k", keys), quantize_leaving(cfg, "k", keys, compiled=False), "keys")


@pytest.mark.parametrize("group", [1, 4, 8])
def test_page_index_equals_the_per_token_rows(group):
    """page_index's tensor arithmetic against :func:`kivi.cache.pages.store_rows`, the plain per-token loop."""
    g = torch.Generator().manual_seed(group)
    tables = [torch.randperm(50, generator=g)[:6].tolist() for _ in range(3)]
    spans = [(2, 8, 24), (0, 0, 16), (1, 40, 8)]  # whole aligned groups of 8
    index = page_index(torch.tensor(tables), spans, P, {1, group})
    for per_row in (1, group):
        want = ([], [])
        for row, start, count in spans:
            b, r = store_rows(tables[row], start, count, P, per_row)
            want[0].extend(b)
            want[1].extend(r)
        assert index[per_row][0].tolist() == want[0] and index[per_row][1].tolist() == want[1]
