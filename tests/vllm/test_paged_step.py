"""kivi.vllm.paged: one layer's step over vLLM-style block tables equals kivi's own cache (no vLLM needed).

Two requests are run through ``paged_step`` with scattered block ids, as vLLM's allocator hands them out
(ring slots never written are NaN, so reading one poisons the output),
in steps that mix a prefill, a chunk into a request that holds tokens and decode rows; every step's
attention output must equal what :class:`kivi.cache.KiviLayer`'s views give through the reference
attention, and the pages must hold what kivi's own store holds.
"""

from __future__ import annotations

import pytest
import torch

from kivi.attention.interface import run_backend
from kivi.cache.layer import KiviLayer
from kivi.cache.view import exact_queries
from kivi.config import KiviConfig
from kivi.vllm.geometry import build_geometry
from kivi.vllm.paged import StepBatch, exact_attention, paged_step

H, HQ, D = 2, 4, 16
P = 32  # vLLM block size


class FakeVllm:
    """Block tables the way vLLM's groups give them: pages of P tokens (full attention) and, per request,
    one block in each of the ``k`` window rings (circular-buffer groups), each from its own pool."""

    def __init__(self, geo, nblocks=64, seed=0):
        self.geo = geo
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(nblocks - 1, generator=g).add(1).tolist()  # block 0 is vLLM's null block
        k = geo.window_rings
        self.rfree = [torch.randperm(nblocks - 1, generator=g).add(1).tolist() for _ in range(k)]
        self.pages = torch.zeros(nblocks, H, P, geo.state_bytes // 4, dtype=torch.float32)
        self.rings = [torch.full((nblocks, H, geo.window_tokens, 2 * D), float("nan")) for _ in range(k)]
        self.ptab: dict[int, list[int]] = {}
        self.rtab: dict[int, list[int]] = {}

    def batch(self, rows):
        """rows: [(rid, past, q_len)] -> StepBatch."""
        qs, seqs = [0], []
        for rid, past, q in rows:
            pt = self.ptab.setdefault(rid, [])
            while len(pt) * P < past + q:
                pt.append(self.free.pop())
            if rid not in self.rtab:  # a request's ring blocks for its whole life
                self.rtab[rid] = [f.pop() for f in self.rfree]
            qs.append(qs[-1] + q)
            seqs.append(past + q)
        width = max(len(self.ptab[r]) for r, _, _ in rows)
        pt = torch.tensor([self.ptab[r] + [0] * (width - len(self.ptab[r])) for r, _, _ in rows])
        rt = torch.tensor([self.rtab[r] for r, _, _ in rows])
        return StepBatch(qs, seqs, pt, rt)


def reference_step(layer: KiviLayer, q, k, v, scale):
    kv, vv = layer.append(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
    qq = q.transpose(0, 1).unsqueeze(0)
    if exact_queries(qq.shape[-2], kv, vv) == qq.shape[-2]:
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
        out = paged_step(cfg, geo, backend, q, k, v, vl.pages, vl.rings, vl.batch(rows), scale,
                         torch.empty(n, HQ, D))
        lo = 0
        for rid, _, ql in rows:
            want = reference_step(refs[rid], q[lo:lo + ql], k[lo:lo + ql], v[lo:lo + ql], scale)
            tol = dict(atol=0, rtol=0) if backend == "reference" else dict(atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out[lo:lo + ql], want, **tol, msg=f"step {rows}, request {rid}")
            lo += ql
    assert 72 + 40 > 2 * len(vl.rings) * geo.window_tokens, "the test must wrap the rings (reuse their slots)"


def test_nan_refused_writes_nothing():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    q, k, v = torch.randn(40, HQ, D), torch.randn(40, H, D), torch.randn(40, H, D)
    v[3] = float("nan")  # leaves the window in this step (40 - 16 = 24 values move)
    before = vl.pages.clone()
    with pytest.raises(ValueError, match="finite|NaN|nan"):
        paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.rings, vl.batch([(0, 0, 40)]), 0.25,
                   torch.empty(40, HQ, D))
    assert torch.equal(vl.pages, before)


def test_rings_too_small_are_refused():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    q, k, v = torch.randn(4, HQ, D), torch.randn(4, H, D), torch.randn(4, H, D)
    with pytest.raises(ValueError, match=f"{geo.window_rings - 1} window rings of {geo.window_tokens} tokens"):
        paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.rings[:-1], vl.batch([(0, 0, 4)]), 0.25,
                   torch.empty(4, HQ, D))
