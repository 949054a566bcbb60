"""kivi.vllm.paged: one layer's step over vLLM-style block tables equals kivi's own cache (no vLLM needed).

Two requests are run through ``paged_step`` with scattered block ids, as vLLM's allocator hands them out,
in steps that mix a prefill, a chunk into a request that holds tokens and decode rows; every step's
attention output must equal what :class:`kivi.cache.KiviLayer`'s views give through the reference
attention, and the pages must hold what kivi's own store holds.
"""

from __future__ import annotations

import pytest
import torch

from kivi.attention.interface import run_backend
from kivi.cache.layer import KiviLayer
from kivi.config import KiviConfig
from kivi.vllm.geometry import build_geometry
from kivi.vllm.paged import StepBatch, exact_attention, paged_step

H, HQ, D = 2, 4, 16
P = 32  # vLLM block size


class FakeVllm:
    """Block tables and slots the way vLLM's two groups give them: pages of P tokens, window blocks of Pw."""

    def __init__(self, geo, nblocks=64, seed=0):
        self.geo = geo
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(nblocks - 1, generator=g).add(1).tolist()  # block 0 is vLLM's null block
        self.wfree = torch.randperm(nblocks - 1, generator=g).add(1).tolist()
        self.pages = torch.zeros(nblocks, H, P, geo.state_bytes // 4, dtype=torch.float32)
        self.window = torch.zeros(nblocks, H, geo.window_tokens, 2 * D, dtype=torch.float32)
        self.ptab: dict[int, list[int]] = {}
        self.wtab: dict[int, list[int]] = {}

    def grow(self, rid, past, seq):
        """Allocate for tokens up to ``seq``; free (and poison) window blocks that slid out, as vLLM's
        sliding-window manager does before a step: blocks whose tokens are all older than the last
        ``sliding_window - 1`` tokens before the step."""
        pt, wt = self.ptab.setdefault(rid, []), self.wtab.setdefault(rid, [])
        pw = self.geo.window_tokens
        while len(pt) * P < seq:
            pt.append(self.free.pop())
        while len(wt) * pw < seq:
            wt.append(self.wfree.pop())
        keep_from = max(0, past - self.geo.sliding_window + 1)
        for j in range(keep_from // pw):
            if wt[j]:
                self.window[wt[j]] = float("nan")  # a read of a freed block would poison the output
                self.wfree.insert(0, wt[j])
                wt[j] = 0

    def batch(self, rows):
        """rows: [(rid, past, q_len)] -> StepBatch."""
        qs, seqs, slots = [0], [], []
        for rid, past, q in rows:
            self.grow(rid, past, past + q)
            qs.append(qs[-1] + q)
            seqs.append(past + q)
            pw = self.geo.window_tokens
            slots += [self.wtab[rid][t // pw] * pw + t % pw for t in range(past, past + q)]
        width = max(len(self.ptab[r]) for r, _, _ in rows)
        wwidth = max(len(self.wtab[r]) for r, _, _ in rows)
        pt = torch.tensor([self.ptab[r] + [0] * (width - len(self.ptab[r])) for r, _, _ in rows])
        wt = torch.tensor([self.wtab[r] + [0] * (wwidth - len(self.wtab[r])) for r, _, _ in rows])
        return StepBatch(qs, seqs, pt, wt, torch.tensor(slots))


def reference_step(layer: KiviLayer, q, k, v, scale):
    kv, vv = layer.append(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
    qq = q.transpose(0, 1).unsqueeze(0)
    if kv.only_full_precision and vv.only_full_precision:
        o = exact_attention(qq, kv.fp, vv.fp, scale)
    else:
        o = run_backend("reference", qq, kv, vv, scaling=scale, attention_mask=None)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("cfg", [KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32),
                                 KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=16, clip=True)],
                         ids=["k2v2-R32", "k4v2-R16-clip"])
def test_paged_step_matches_kivi_layer(cfg, backend):
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    g = torch.Generator().manual_seed(1)
    # (rid, past, q_len) per step: prefill A; prefill B + decode A; chunk into B + decode A; decodes
    steps = [[(0, 0, 70)], [(1, 0, 45), (0, 70, 1)], [(0, 71, 1), (1, 45, 50)]]
    steps += [[(0, 72 + j, 1), (1, 95 + j, 1)] for j in range(40)]
    refs = {0: KiviLayer(cfg), 1: KiviLayer(cfg)}
    scale = D ** -0.5
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, H, H))
        out = paged_step(cfg, geo, backend, q, k, v, vl.pages, vl.window, vl.batch(rows), scale,
                         torch.empty(n, HQ, D))
        lo = 0
        for rid, _, ql in rows:
            want = reference_step(refs[rid], q[lo:lo + ql], k[lo:lo + ql], v[lo:lo + ql], scale)
            tol = dict(atol=0, rtol=0) if backend == "reference" else dict(atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out[lo:lo + ql], want, **tol, msg=f"step {rows}, request {rid}")
            lo += ql
    assert 0 in vl.wtab[0] and 0 in vl.wtab[1], "the test must free window blocks to show they are not read"


def test_nan_refused_writes_nothing():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    q, k, v = torch.randn(40, HQ, D), torch.randn(40, H, D), torch.randn(40, H, D)
    v[3] = float("nan")  # leaves the window in this step (40 - 16 = 24 values move)
    before = vl.pages.clone()
    with pytest.raises(ValueError, match="finite|NaN|nan"):
        paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.window, vl.batch([(0, 0, 40)]), 0.25,
                   torch.empty(40, HQ, D))
    assert torch.equal(vl.pages, before)
