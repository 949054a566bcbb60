"""kivi.paged.decode_call: a step's decode rows through the batched paged decode kernel equal the per-request path.

Two copies of the same vLLM-style cache (scattered block ids, rings that start as NaN, all ``k`` rings in one
allocation as vLLM lays them out, so the kernel reads their rows in place) run the same steps,
one with ``paged_step(..., batched_decode=True)`` (one kernel call per step for the decode rows with
something stored) and one with ``batched_decode=False`` (request by request through ``run_backend``).
Many requests of odd lengths, some still with nothing stored, prefills and chunks mixed into decode steps,
windows partly full and rings wrapping: the outputs agree to float rounding, and pages and rings stay
bit-identical (both paths quantize the same rows). With sink tokens the kernel reads each request's sink
rows too (from column 0, the window from ``w0 = S``), also for requests whose sink is still filling. No vLLM
needed.
"""

from __future__ import annotations

import pytest
import torch

from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged import decode_call as vdecode
from kivi.paged.decode_call import decode_kernel, stores_any
from kivi.paged.forward import StepBatch, decode_rows, paged_step
from kivi.paged.geometry import build_geometry

pytestmark = pytest.mark.skipif(not numba_available(), reason="the paged decode kernel needs numba")

H, HQ, D, P = 2, 6, 16, 16


class Cache:
    """Pages and window rings of one layer as vLLM's groups hand them out (block 0 is vLLM's null block)."""

    def __init__(self, geo, dtype, nblocks=96, seed=0, layers=1, layer=0):
        H, P, D = geo.num_kv_heads, geo.page_size, geo.head_dim  # the module's names, for any geometry
        self.page_size = P
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(nblocks - 1, generator=g).add(1).tolist()
        k = geo.window_rings
        self.rfree = [torch.randperm(nblocks - 1, generator=g).add(1).tolist() for _ in range(k)]
        # vLLM's block-outermost packing when layers > 1: block b of layer l at (b * layers + l) * block bytes
        # of one shared allocation (other layers' pages between this layer's blocks)
        bb = H * P * geo.state_bytes
        buf = torch.full((nblocks * layers * bb,), 255, dtype=torch.uint8)
        self.pages = buf.as_strided((nblocks, H, P, geo.state_bytes), (layers * bb, P * geo.state_bytes,
                                                                        geo.state_bytes, 1), layer * bb)
        self.pages.zero_()
        # the k rings in one allocation, as vLLM overlays its groups on one buffer (ring r's block b at
        # (b * k + r) * block bytes): the kernel reads their rows in place (kivi.paged.geometry.ring_pool)
        rbuf = torch.full((nblocks * k * bb // dtype.itemsize,), float("nan"), dtype=dtype)
        rw = geo.window_tokens * 2 * D
        self.rings = [rbuf.as_strided((nblocks, H, geo.window_tokens, 2 * D), (k * bb // dtype.itemsize, rw, 2 * D, 1),
                                      r * bb // dtype.itemsize) for r in range(k)]
        self.ptab: dict[int, list[int]] = {}
        self.rtab: dict[int, list[int]] = {}

    def batch(self, rows):
        """rows: [(rid, past, q_len)] -> StepBatch."""
        qs, seqs = [0], []
        P = self.page_size
        for rid, past, q in rows:
            pt = self.ptab.setdefault(rid, [])
            while len(pt) * P < past + q:
                pt.append(self.free.pop())
            if rid not in self.rtab:
                self.rtab[rid] = [f.pop() for f in self.rfree]
            qs.append(qs[-1] + q)
            seqs.append(past + q)
        width = max(len(self.ptab[r]) for r, _, _ in rows) + 1  # one unused column, as vLLM pads
        pt = torch.tensor([self.ptab[r] + [0] * (width - len(self.ptab[r])) for r, _, _ in rows], dtype=torch.int32)
        rt = torch.tensor([self.rtab[r] for r, _, _ in rows], dtype=torch.int32)
        return StepBatch(qs, seqs, pt, rt)


def steps_of(prompts: dict[int, int], late: dict[int, tuple[int, int]], decode_steps: int):
    """Prefill every ``prompts`` request (rid -> length) in the first step; ``late`` requests (rid -> (step,
    length)) join in a later step as a prefill, then their next step is a chunk of 7 tokens; every other
    request decodes one token per step."""
    held = {}
    out = [[(rid, 0, n) for rid, n in prompts.items()]]
    held.update(prompts)
    chunked = set()
    for s in range(1, decode_steps + 1):
        rows = []
        for rid in sorted(held):
            q = 7 if rid in late and rid not in chunked else 1
            chunked.add(rid)
            rows.append((rid, held[rid], q))
            held[rid] += q
        for rid, (step, n) in late.items():
            if step == s:
                rows.insert(len(rows) // 2, (rid, 0, n))
                held[rid] = n
        out.append(rows)
    return out


CONFIGS = [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16),
           KiviConfig(k_bits=4, v_bits=3, group_size=8, residual_length=8, clip=True),
           KiviConfig(k_bits=2, v_bits=4, group_size=16, residual_length=16, symmetric=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["k2v2-G8-R16", "k4v3-G8-R8-clip", "k2v4-G16-R16-sym"])
def test_batched_decode_equals_per_request(cfg, dtype):
    run_both(cfg, dtype)


SINK_CONFIGS = [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, sink_tokens=4),
                KiviConfig(k_bits=4, v_bits=2, group_size=8, residual_length=8, sink_tokens=5),
                KiviConfig(k_bits=2, v_bits=4, group_size=16, residual_length=16, symmetric=True, sink_tokens=1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", SINK_CONFIGS, ids=["k2v2-G8-R16-S4", "k4v2-G8-R8-S5", "k2v4-G16-R16-sym-S1"])
def test_batched_decode_with_sinks_equals_per_request(cfg, dtype, monkeypatch):
    """The kernel is handed each row's sink (``counts`` columns 0 and 3, ``w0 = S``), rows whose sink is not
    full yet included."""
    calls = []
    run = vdecode.run_paged_decode
    monkeypatch.setattr(vdecode, "run_paged_decode",
                        lambda call, q, **k: calls.append((call.counts.clone(), call.w0)) or run(call, q, **k))
    run_both(cfg, dtype)
    S = cfg.sink_tokens
    assert calls and all(w0 == S for _, w0 in calls)
    sinks = torch.cat([c[:, [0, 3]] for c, _ in calls])
    assert (sinks[:, 0] == sinks[:, 1]).all() and (sinks == S).any()
    if S > 1:
        assert ((sinks > 0) & (sinks < S)).any(), "a row with its sink still filling must reach the kernel"


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_batched_decode_reads_interleaved_layers(layer):
    """vLLM's block-outermost packing: each layer's blocks are 3 pages apart in one allocation (the bytes
    between are another layer's, 0xFF here): the kernel must read this layer's pages only."""
    run_both(CONFIGS[0], torch.float32, layers=3, layer=layer, decode_steps=20)


def run_both(cfg, dtype, decode_steps=44, backend="cpu", **layout):
    """``backend``'s kernel (``"cpu"``: numba; ``"triton"``: the Triton kernel on the same inputs) for the decode
    rows against the per-request ``"cpu"`` path."""
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype)
    fast, slow = Cache(geo, dtype, **layout), Cache(geo, dtype, **layout)
    assert decode_kernel(cfg, geo, backend, fast.pages, fast.rings) is not None, "the kernel must apply"
    prompts = {0: 3, 1: 13, 2: 29, 3: 41, 4: 1, 5: 66, 6: 17, 7: 90}
    steps = steps_of(prompts, late={8: (5, 11), 9: (9, 35)}, decode_steps=decode_steps)
    g = torch.Generator().manual_seed(2)
    scale = D ** -0.5
    served = 0
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, H, H))
        batch, same = fast.batch(rows), slow.batch(rows)  # the same block ids: both draw from equally seeded pools
        assert torch.equal(batch.page_table, same.page_table) and torch.equal(batch.ring_table, same.ring_table)
        served += sum(stores_any(cfg, batch.seq_lens[i] - 1) for i in decode_rows(batch))
        got = paged_step(cfg, geo, backend, q, k, v, fast.pages, fast.rings, batch, scale,
                         torch.empty(n, HQ, D, dtype=dtype))
        want = paged_step(cfg, geo, "cpu", q, k, v, slow.pages, slow.rings, same, scale,
                          torch.empty(n, HQ, D, dtype=dtype), batched_decode=False)
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
        torch.testing.assert_close(got, want, **tol, msg=f"step {rows}")
        assert torch.equal(fast.pages.view(torch.uint8), slow.pages.view(torch.uint8)), f"pages differ after {rows}"
        for a, b in zip(fast.rings, slow.rings):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"rings differ after {rows}"
    assert served > 6 * decode_steps, f"the kernel served only {served} rows"
    assert max(prompts.values()) + decode_steps > 2 * geo.window_rings * geo.window_tokens, "the rings must wrap"


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [CONFIGS[0], SINK_CONFIGS[1], CONFIGS[2]], ids=["k2v2-G8-R16", "k4v2-G8-R8-S5",
                                                                                 "k2v4-G16-R16-sym"])
def test_triton_kernel_on_the_same_inputs_equals_per_request(cfg, dtype, monkeypatch):
    """The batched paged decode kernel's Triton form (kivi.kernels.triton_paged, under TRITON_INTERPRET=1 on these
    CPU tensors) serves the plugin's decode rows from the inputs the numba kernel gets: the same outputs as the
    per-request path, pages and rings bit-identical, every decode row with something stored through it."""
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)
    from kivi.kernels import triton_paged

    calls = []
    kernel = triton_paged.triton_paged_decode
    monkeypatch.setattr(triton_paged, "triton_paged_decode",
                        lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    run_both(cfg, dtype, decode_steps=12, backend="triton")
    assert len(calls) >= 12 and sum(calls) > 6 * 12


def test_where_the_kernel_applies(monkeypatch):
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    cache = Cache(geo, torch.float32)
    pages, rings = cache.pages, cache.rings
    assert decode_kernel(cfg, geo, "cpu", pages, rings) is not None
    assert decode_kernel(cfg, geo, "reference", pages, rings) is None  # the ground truth goes request by request
    comp = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, residual_bits=1)
    geo_comp = build_geometry(comp, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    comp_cache = Cache(geo_comp, torch.float32)
    assert decode_kernel(comp, geo_comp, "cpu", comp_cache.pages, comp_cache.rings) is None
    # rings in separate allocations, or one not on a whole block of the shared one: no in-place rows
    apart = [r.clone() for r in rings]
    assert decode_kernel(cfg, geo, "cpu", pages, apart) is None
    shifted = [rings[0]] + [r[1:] if j == 1 else r for j, r in enumerate(rings[1:], 1)]
    assert decode_kernel(cfg, geo, "cpu", pages, shifted) is not None  # whole blocks: still in place
    storage = rings[0].untyped_storage()
    odd = torch.empty(0).set_(storage, rings[0].storage_offset() + 2 * D, rings[0].shape, rings[0].stride())
    assert decode_kernel(cfg, geo, "cpu", pages, [odd] + rings[1:]) is None
    monkeypatch.setattr(vdecode, "numba_problem", lambda: "numba is not installed")
    assert decode_kernel(cfg, geo, "cpu", pages, rings) is None


def test_stores_any_follows_the_schedule():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16)
    # values leave the window once more than R are held, before keys (a whole group with R newer behind it)
    assert [p for p in range(60) if stores_any(cfg, p)] == list(range(17, 60))


def test_a_step_quantizes_what_leaves_every_window_in_one_call_per_side(monkeypatch):
    """Prefills of several requests in one step, then decode steps: what leaves all the windows of a step is
    quantized in one call per side (not one per request), and the pages still equal the per-request path's."""
    from kivi.paged import step as paged_step_module

    cfg = CONFIGS[0]
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    fast, slow = Cache(geo, torch.float32), Cache(geo, torch.float32)
    calls = []
    quantize = paged_step_module.quantize_leaving
    monkeypatch.setattr(paged_step_module, "quantize_leaving",
                        lambda cfg, side, x: calls.append(side) or quantize(cfg, side, x))
    steps = steps_of({0: 40, 1: 57, 2: 33, 3: 80, 4: 26}, late={}, decode_steps=12)
    g = torch.Generator().manual_seed(3)
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, H, H))
        calls.clear()
        paged_step(cfg, geo, "cpu", q, k, v, fast.pages, fast.rings, fast.batch(rows), 0.25, torch.empty(n, HQ, D))
        assert len(calls) == len(set(calls)), f"step {rows}: quantize calls {calls}"
        if rows is steps[0]:  # five prefills, each with keys and values leaving the window
            assert sorted(calls) == ["k", "v"], calls
        paged_step(cfg, geo, "cpu", q, k, v, slow.pages, slow.rings, slow.batch(rows), 0.25, torch.empty(n, HQ, D),
                   batched_decode=False)
        assert torch.equal(fast.pages.view(torch.uint8), slow.pages.view(torch.uint8)), f"pages differ after {rows}"
