"""kivi.paged.forward: one layer's step over vLLM-style block tables equals kivi's own cache (no vLLM needed).

Two requests are run through ``paged_step`` with scattered block ids, as vLLM's allocator hands them out
(ring slots never written are NaN, so reading one poisons the output),
in steps that mix a prefill, a chunk into a request that holds tokens and decode rows; every step's
attention output must equal what :class:`kivi.cache.KiviLayer`'s views give through the reference
attention, and the pages must hold what kivi's own store holds. With sink tokens (``S`` = 1, 4, 5: 5 does
not divide ``G``) the sink rows in the rings must stay bit-identical to the tokens as they arrived and to
``KiviLayer``'s sink, whichever step (prefill, chunk, decode) filled the sink.

Backends: ``"reference"`` (exact), ``"cpu"`` (the numba kernels) and ``"triton"``: the plugin's GPU path (prefill by
SDPA, chunks through kivi's Triton attention, decode rows through the batched paged Triton kernel, torch writes),
run here on CPU tensors under ``TRITON_INTERPRET=1`` (CI's step 2; skipped without it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kivi.attention.interface import run_backend
from kivi.cache.layer import KiviLayer
from kivi.cache.pages import gather_pages
from kivi.cache.view import exact_queries
from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged.decode_call import decode_kernel
from kivi.paged.forward import StepBatch, exact_attention, paged_step
from kivi.paged.geometry import block_field_views, build_geometry
from kivi.paged.plan import step_plan
from kivi.paged.ring import ring_slot, slot_place

H, HQ, D = 2, 4, 16
P = 32  # vLLM block size
BACKENDS = ["reference", "cpu", pytest.param("triton", marks=pytest.mark.triton)]


def needs(backend):
    """Skip a ``"triton"`` case where Triton's interpreter cannot run it."""
    if backend == "triton":
        from tests.helpers import triton_skip_reason

        reason = triton_skip_reason()
        if reason:
            pytest.skip(reason)


class FakeVllm:
    """Block tables the way vLLM's groups give them: pages of P tokens (full attention) and, per request,
    one block in each of the ``k`` window rings (circular-buffer groups), each from its own pool."""

    def __init__(self, geo, nblocks=64, seed=0, dtype=torch.float32, dirty=False):
        self.geo = geo
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(nblocks - 1, generator=g).add(1).tolist()  # block 0 is vLLM's null block
        k = geo.window_rings
        self.rfree = [torch.randperm(nblocks - 1, generator=g).add(1).tolist() for _ in range(k)]
        size = dtype.itemsize
        self.pages = torch.zeros(nblocks, H, P, geo.state_bytes // size, dtype=dtype)
        if dirty:  # blocks as a freed request left them (0xFF bytes: NaN in every float field), not zeroed
            self.pages.view(torch.uint8).fill_(255)
        # the k rings overlay one allocation as vLLM's groups do (ring r's block b at (b * k + r) * block bytes),
        # so with the "cpu" backend decode rows go through the batched kernel reading them in place
        bb = geo.block_bytes // size
        rbuf = torch.full((nblocks * k * bb,), float("nan"), dtype=dtype)
        self.rings = [rbuf.as_strided((nblocks, H, geo.window_tokens, 2 * D),
                                      (k * bb, geo.window_tokens * 2 * D, 2 * D, 1), r * bb) for r in range(k)]
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


def run_steps(cfg, backend, steps, seed=1, dtype=torch.float32, tol=None, dirty=False):
    """Run ``steps`` ([(rid, past, q_len)] each) through ``paged_step`` and each request's own ``KiviLayer``;
    every output must match (``tol``: by default exact for the reference backend). ``dirty``: the pages start
    as 0xFF bytes. Returns the fake vLLM cache, the layers and each request's keys / values."""
    needs(backend)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype)
    vl = FakeVllm(geo, dtype=dtype, dirty=dirty)
    g = torch.Generator().manual_seed(seed)
    refs, inputs = {}, {}
    scale = D ** -0.5
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, H, H))
        out = paged_step(cfg, geo, backend, q, k, v, vl.pages, vl.rings, vl.batch(rows), scale,
                         torch.empty(n, HQ, D, dtype=dtype))
        lo = 0
        for rid, past, ql in rows:
            layer = refs.setdefault(rid, KiviLayer(cfg))
            assert layer.get_seq_length() == past
            want = reference_step(layer, q[lo:lo + ql], k[lo:lo + ql], v[lo:lo + ql], scale)
            inputs.setdefault(rid, []).append((k[lo:lo + ql], v[lo:lo + ql]))
            if tol is None:
                tol = dict(atol=0, rtol=0) if backend == "reference" else dict(atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out[lo:lo + ql], want, **tol, msg=f"step {rows}, request {rid}")
            lo += ql
    return vl, refs, {rid: [torch.cat(x) for x in zip(*kv)] for rid, kv in inputs.items()}


CONFIGS = [KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32),
           KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=16, clip=True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["k2v2-R32", "k4v2-R16-clip"])
def test_paged_step_matches_kivi_layer(cfg, backend):
    # (rid, past, q_len) per step: prefill A; prefill B + decode A; chunk into B + decode A; decodes
    steps = [[(0, 0, 70)], [(1, 0, 45), (0, 70, 1)], [(0, 71, 1), (1, 45, 50)]]
    steps += [[(0, 72 + j, 1), (1, 95 + j, 1)] for j in range(40)]
    vl, _, _ = run_steps(cfg, backend, steps)
    assert 72 + 40 > 2 * len(vl.rings) * vl.geo.window_tokens, "the test must wrap the rings (reuse their slots)"
    if backend != "reference" and (backend == "triton" or numba_available()):  # decode rows went through a kernel
        assert decode_kernel(cfg, vl.geo, backend, vl.pages, vl.rings) is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_are_never_read_before_written(backend):
    """vLLM hands a request blocks a finished one used: no byte of a page is read before the step that writes it
    (the pages start as 0xFF, NaN in every scale and zero-point field, and the outputs still equal KiviLayer's)."""
    steps = [[(0, 0, 70), (1, 0, 5)], [(1, 5, 50), (0, 70, 1)]]
    steps += [[(0, 71 + j, 1), (1, 55 + j, 1)] for j in range(24)]
    run_steps(CONFIGS[1], backend, steps, dirty=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_step_bfloat16_matches_kivi_layer(backend):
    """A bfloat16 model's caches (the pages' parameters in bfloat16, values quantized in one compiled pass on the
    CPU): the same steps give KiviLayer's outputs, and the pages hold its stored values bit for bit."""
    cfg = CONFIGS[0]
    steps = [[(0, 0, 70)], [(1, 0, 45), (0, 70, 1)], [(0, 71, 1), (1, 45, 50)]]
    steps += [[(0, 72 + j, 1), (1, 95 + j, 1)] for j in range(40)]
    tol = dict(atol=0, rtol=0) if backend == "reference" else dict(atol=2e-2, rtol=2e-2)
    vl, refs, _ = run_steps(cfg, backend, steps, dtype=torch.bfloat16, tol=tol)
    views = block_field_views(vl.pages, vl.geo, "v")
    for rid, layer in refs.items():
        store = layer.v.store
        n = store.length
        assert n > 2 * P, "the values must fill pages"
        got = gather_pages(views, torch.tensor(vl.ptab[rid]), fmt=cfg.side_format("v"), head_dim=D)
        want = store.read_range(0, n)
        assert want.scale.dtype == torch.bfloat16
        for name in ("packed", "scale", "offset"):
            assert torch.equal(getattr(got, name)[:, :, :n], getattr(want, name)), f"request {rid} values' {name}"


def sink_steps(decodes=40):
    """A: a prefill past the sink; B: a prefill, then a chunk into it; C: a short prefill whose sink fills one
    decode step at a time; D: a short prefill, then a chunk that fills the sink and stores (a per-query
    boundary across the sink); all decoding together after."""
    steps = [[(0, 0, 70), (2, 0, 10), (3, 0, 12)], [(1, 0, 45), (0, 70, 1), (2, 10, 1), (3, 12, 30)],
             [(0, 71, 1), (1, 45, 50), (2, 11, 1), (3, 42, 1)]]
    steps += [[(0, 72 + j, 1), (1, 95 + j, 1), (2, 12 + j, 1), (3, 43 + j, 1)] for j in range(decodes)]
    return steps


# the interpreter takes ~45 s a case at 80 decode steps: Triton with the sink that does not divide G only, and 40
# steps (still enough to wrap the window's ring twice in both configs: the last assertion of the test)
SINK_CASES = [(s, b) for s in (1, 4, 5) for b in ("reference", "cpu")] + [
    pytest.param(5, "triton", marks=pytest.mark.triton)]
SINK_DECODES = {"reference": 80, "cpu": 80, "triton": 40}


@pytest.mark.parametrize("sink, backend", SINK_CASES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["k2v2-R32", "k4v2-R16-clip"])
def test_paged_step_with_sinks_matches_kivi_layer(cfg, sink, backend):
    """Sink tokens: the same steps equal KiviLayer with ``sink_tokens`` = S, and the sink rows kept in the
    rings' slots [0, S) are the tokens as they arrived, bit for bit, as KiviLayer's sink."""
    cfg = dataclasses.replace(cfg, sink_tokens=sink)
    decodes = SINK_DECODES[backend]
    vl, refs, inputs = run_steps(cfg, backend, sink_steps(decodes))
    geo = vl.geo
    assert geo.window_rings * geo.window_tokens >= sink + cfg.residual_length + cfg.group_size - 1
    for rid, layer in refs.items():
        ring_ids = torch.tensor(vl.rtab[rid])
        pw = geo.window_tokens
        ring, row = slot_place(ring_slot(torch.arange(sink), len(ring_ids) * pw - sink, sink), pw)
        block = ring_ids[ring]
        rows = torch.stack([vl.rings[r][b, :, w] for r, b, w in zip(ring.tolist(), block.tolist(), row.tolist())],
                           dim=1)  # [H, S, 2D]
        for side, (lo, x) in zip(("k", "v"), ((0, inputs[rid][0]), (D, inputs[rid][1]))):
            assert getattr(layer, side).sink_len == sink, f"request {rid} must have filled its sink"
            want = x[:sink].transpose(0, 1)  # [H, S, D] as the request's first tokens arrived
            assert torch.equal(rows[..., lo:lo + D], want), f"request {rid} {side} sink rows"
            assert torch.equal(getattr(layer, side).sink[0], want)
    ring_part = geo.window_rings * geo.window_tokens - sink
    assert 72 + decodes - sink > 2 * ring_part, "the test must wrap the window's ring (reuse its slots)"


@pytest.mark.parametrize("sink", [0, 4])
def test_nan_refused_writes_nothing(sink):
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16, sink_tokens=sink)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    if sink:  # a request holding its sink and a window; the chunk stores values and keys after the sink
        paged_step(cfg, geo, "reference", torch.randn(20, HQ, D), torch.randn(20, H, D), torch.randn(20, H, D),
                   vl.pages, vl.rings, vl.batch([(0, 0, 20)]), 0.25, torch.empty(20, HQ, D))
    past = 20 if sink else 0
    q, k, v = torch.randn(40, HQ, D), torch.randn(40, H, D), torch.randn(40, H, D)
    v[3] = float("nan")  # leaves the window for the pages in this step (past + 40 - S - 16 values are stored)
    before, rings = vl.pages.clone(), [r.clone() for r in vl.rings]
    with pytest.raises(ValueError, match="finite|NaN|nan"):
        paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.rings, vl.batch([(0, past, 40)]), 0.25,
                   torch.empty(40, HQ, D))
    assert torch.equal(vl.pages, before)
    for r, b in zip(vl.rings, rings):
        assert torch.equal(r.nan_to_num(7.0), b.nan_to_num(7.0)), "a refused step wrote a ring"


@pytest.mark.parametrize("sink", [0, 5])
def test_rings_too_small_are_refused(sink):
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32, sink_tokens=sink)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    q, k, v = torch.randn(4, HQ, D), torch.randn(4, H, D), torch.randn(4, H, D)
    with pytest.raises(ValueError, match=f"{geo.window_rings - 1} window rings of {geo.window_tokens} tokens"):
        paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.rings[:-1], vl.batch([(0, 0, 4)]), 0.25,
                   torch.empty(4, HQ, D))


@pytest.mark.parametrize("other", [{"sink_tokens": 4}, {"residual_length": 32}])
def test_a_plan_made_for_another_geometry_is_refused(other):
    """The metadata builder makes one plan per step for all layers (``StepBatch.plan``): a layer whose rings
    or sink differ from the plan's is refused by name, before anything is written."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    ocfg = dataclasses.replace(cfg, **other)
    ogeo = build_geometry(ocfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    vl = FakeVllm(geo)
    batch = dataclasses.replace(vl.batch([(0, 0, 4)]), plan=step_plan(ocfg, ogeo, [0, 4], [4]))
    q, k, v = torch.randn(4, HQ, D), torch.randn(4, H, D), torch.randn(4, H, D)
    before, rings = vl.pages.clone(), [r.clone() for r in vl.rings]
    with pytest.raises(ValueError, match=rf"plan was made for {ogeo.window_rings * ogeo.window_tokens} ring slots.*"
                                         rf"this layer has {geo.window_rings * geo.window_tokens}"):
        paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.rings, batch, 0.25, torch.empty(4, HQ, D))
    assert torch.equal(vl.pages, before)
    assert all(torch.equal(r.nan_to_num(7.0), b.nan_to_num(7.0)) for r, b in zip(vl.rings, rings))
    out = torch.empty(4, HQ, D)  # the layer's own plan runs
    paged_step(cfg, geo, "reference", q, k, v, vl.pages, vl.rings, vl.batch([(0, 0, 4)]), 0.25, out)
    assert out.isfinite().all()
