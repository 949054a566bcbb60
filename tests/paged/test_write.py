"""kivi.paged.write: a decode-only step's writes in one compiled call leave the pages and rings bit for bit as the
torch writes do (no vLLM needed).

Two copies of a vLLM-style cache (:class:`tests.paged.test_decode_call.Cache`: scattered blocks, rings in one
allocation that start as NaN) run the same steps through ``paged_step`` with the batched decode kernel, one with
``compiled_writes=True`` (the default: a step whose every request is a kernel row writes in one call of
:func:`kivi.paged.write_kernel.decode_write`) and one with ``compiled_writes=False`` (leaving rows, one quantize
call per side, indexed page and ring writes). Every width, group sizes 4 / 8 / 16, head sizes whose 3-bit rows
end in a partial run, windows of 1 or 2 groups, sinks, clipping on either side, float32 and bfloat16 rings,
float32 parameters for bfloat16 rings, tiny to large magnitudes and all-constant groups: after every step both
caches are byte-identical and the outputs equal. A non-finite leaving value writes nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged import forward as vpaged
from kivi.paged.decode_call import decode_kernel
from kivi.paged.forward import paged_step
from kivi.paged.geometry import build_geometry
from kivi.paged.plan import step_plan
from kivi.paged.write import decode_writer, write_step

from .test_decode_call import Cache, steps_of

pytestmark = pytest.mark.skipif(not numba_available(), reason="the compiled writes need numba")

H, HQ = 2, 4


def counting(monkeypatch):
    """Count the steps that took the compiled writes."""
    calls = []
    real = vpaged.write_step
    monkeypatch.setattr(vpaged, "write_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def snapshot(cache):
    return cache.pages.view(torch.uint8).clone(), [r.view(torch.uint8).clone() for r in cache.rings]


def same_bytes(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def run_pair(cfg, dtype, D, P, steps, *, mag=1.0, constant=(), seed=0, backend="cpu", nblocks=64):
    """Run ``steps`` on two caches, compiled writes against torch writes; byte-identical caches and equal outputs
    after every step. ``constant``: steps whose every key / value is one number (all-constant groups).
    ``backend``: ``"cpu"`` (the numba writes) or ``"triton"`` (the Triton writes, tests/paged/test_write_triton.py)."""
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype)
    fast, slow = Cache(geo, dtype, nblocks=nblocks, seed=seed), Cache(geo, dtype, nblocks=nblocks, seed=seed)
    kernel = decode_kernel(cfg, geo, backend, fast.pages, fast.rings)
    assert kernel is not None and kernel.writer is not None, "the compiled writes must apply"
    g = torch.Generator().manual_seed(seed)
    for s, rows in enumerate(steps):
        n = sum(q for _, _, q in rows)
        q = torch.randn(n, HQ, D, generator=g).to(dtype)
        if s in constant:
            k = torch.full((n, H, D), 0.37 * mag).to(dtype)
            v = torch.full((n, H, D), -1.5 * mag).to(dtype)
        else:
            k, v = ((torch.randn(n, H, D, generator=g) * mag).to(dtype) for _ in range(2))
        batch, same = fast.batch(rows), slow.batch(rows)
        got = paged_step(cfg, geo, backend, q, k, v, fast.pages, fast.rings, batch, D ** -0.5,
                         torch.empty(n, HQ, D, dtype=dtype), kernel=kernel)
        want = paged_step(cfg, geo, backend, q, k, v, slow.pages, slow.rings, same, D ** -0.5,
                          torch.empty(n, HQ, D, dtype=dtype), compiled_writes=False)
        assert same_bytes(snapshot(fast), snapshot(slow)), f"caches differ after step {s}: {rows}"
        assert torch.equal(got, want), f"outputs differ at step {s}"


@settings(max_examples=30, deadline=None)
@given(k_bits=st.sampled_from([1, 2, 3, 4, 8]), v_bits=st.sampled_from([1, 2, 3, 4, 8]),
       shape=st.sampled_from([(4, 16, 16), (8, 16, 16), (16, 16, 32), (4, 12, 16), (8, 24, 16)]),
       windows=st.sampled_from([1, 2]), sink=st.sampled_from([0, 1, 3]),
       clip=st.sampled_from([False, True, "keys", "values"]), dtype=st.sampled_from(["fp32", "bf16", "bf16-fp32"]),
       mag=st.sampled_from([1e-3, 1.0, 300.0]), constant=st.booleans(), seed=st.integers(0, 2**16))
def test_compiled_writes_equal_the_torch_writes(k_bits, v_bits, shape, windows, sink, clip, dtype, mag, constant,
                                                seed):
    G, D, P = shape
    rows_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    cfg = KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=windows * G, sink_tokens=sink,
                     clip=clip, scale_dtype="float32" if dtype == "bf16-fp32" else "auto")
    R = cfg.residual_length
    # three requests whose prompts already store tokens, one short one that starts storing a few steps in, a
    # prefill joining mid-run (a step the torch writes serve), then decode steps past several key groups
    prompts = {0: R + G + 3, 1: 2 * R + 3 * G + 1, 2: R + 1, 3: 2}
    steps = steps_of(prompts, late={4: (6, R + 5)}, decode_steps=3 * G + 8)
    run_pair(cfg, rows_dtype, D, P, steps, mag=mag, constant=set(range(2, 2 + 2 * G)) if constant else (),
             seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_most_decode_steps_take_the_compiled_writes(dtype, monkeypatch):
    """The steps whose every request is a kernel row take the compiled writes (the rest: the torch writes);
    keys leave whole groups through it, values every step."""
    calls = counting(monkeypatch)
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, sink_tokens=2)
    steps = steps_of({0: 30, 1: 45, 2: 61}, late={3: (10, 40)}, decode_steps=40)
    kinds = []
    real = vpaged.step_plan

    def plan(*a):
        p = real(*a)
        kernel_only = p.kernel is not None and not p.others
        kinds.append((kernel_only, kernel_only and p.kernel.leaving["k"] is not None))
        return p

    monkeypatch.setattr(vpaged, "step_plan", plan)
    run_pair(cfg, dtype, 16, 16, steps)
    fast = kinds[0::2]  # each step is planned once per cache: the compiled one first
    assert len(calls) == sum(k for k, _ in fast) >= 35
    assert sum(k and keys for k, keys in fast) >= 3, "key groups must leave through the compiled writes"


def test_a_non_finite_leaving_value_writes_nothing():
    """A NaN that reaches the pages (it leaves the window R steps after it arrived) is refused as the torch path
    refuses it, with the pages and rings as they were before the step."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8)
    geo = build_geometry(cfg, page_size=16, num_kv_heads=H, head_dim=16, dtype=torch.float32)
    caches = {mode: Cache(geo, torch.float32, nblocks=64) for mode in (True, False)}
    steps = steps_of({0: 20, 1: 33}, late={}, decode_steps=20)
    g = torch.Generator().manual_seed(5)
    raised = {}
    for s, rows in enumerate(steps):
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, 16, generator=g) for h in (HQ, H, H))
        if s == 3:
            v[-1, 1, 5] = float("nan")  # request 1's value of step 3
        for mode, cache in caches.items():
            if mode in raised:
                continue
            before = snapshot(cache)
            batch = cache.batch(rows)
            try:
                paged_step(cfg, geo, "cpu", q, k, v, cache.pages, cache.rings, batch, 0.25, torch.empty(n, HQ, 16),
                           compiled_writes=mode)
            except ValueError as e:
                assert "NaN or Inf" in str(e)
                assert same_bytes(snapshot(cache), before), f"compiled_writes={mode} wrote before refusing"
                raised[mode] = s
    assert raised == {True: 3 + 8, False: 3 + 8}, raised


def test_where_the_compiled_writes_apply():
    base = dict(k_bits=2, v_bits=2, group_size=8, residual_length=8)

    def writer(dtype=torch.float32, **kw):
        cfg = KiviConfig(**{**base, **kw})
        geo = build_geometry(cfg, page_size=16, num_kv_heads=H, head_dim=16, dtype=dtype)
        cache = Cache(geo, dtype, nblocks=8)
        kernel = decode_kernel(cfg, geo, "cpu", cache.pages, cache.rings)
        return None if kernel is None else kernel.writer

    assert writer() is not None and writer(torch.bfloat16) is not None
    assert writer(clip=True) is not None and writer(sink_tokens=3) is not None
    assert writer(symmetric=True) is None  # no offsets: the torch writes
    assert writer(check_finite=False) is None  # a NaN poisons its group there: the torch writes store it
    assert writer(torch.float16) is None  # float16 parameters and rows
    assert writer(torch.bfloat16, scale_dtype="float16") is None
    w = writer(torch.bfloat16)
    x = torch.zeros(3, H, 16, dtype=torch.bfloat16)
    assert w.takes(x, x) and not w.takes(x.float(), x)  # the input is copied to the rings bit for bit


def test_write_step_refuses_a_step_with_other_requests_and_groups_that_are_not_whole():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8)
    geo = build_geometry(cfg, page_size=16, num_kv_heads=H, head_dim=16, dtype=torch.float32)
    cache = Cache(geo, torch.float32, nblocks=16)
    kernel = decode_kernel(cfg, geo, "cpu", cache.pages, cache.rings)
    rows = [(0, 17, 1), (1, 0, 5)]  # a decode row and a prefill
    batch = cache.batch(rows)
    plan = step_plan(cfg, geo, batch.query_start, batch.seq_lens)
    k = torch.zeros(6, H, 16)
    with pytest.raises(ValueError, match="every request is a decode kernel row"):
        write_step(kernel.writer, plan, batch.page_table, batch.ring_table, k, k)
    from kivi.paged.write_kernel import decode_write

    w = kernel.writer
    bad = torch.tensor([[0, 3, -1, 4]] * 8).numpy()  # a key group starting at store position 4 (G = 8)
    empty = torch.zeros(0, 4, dtype=torch.long).numpy()
    before = snapshot(cache)
    rc = decode_write(w.pool, w.lay, w.krows, w.vrows, w.rbase, w.rstep, batch.ring_table.numpy(),
                      batch.page_table.numpy(), k.numpy(), k.numpy(), bad, empty, torch.zeros(0, 3).long().numpy(),
                      w.shrinks["k"], w.shrinks["v"])
    assert rc == 2 and same_bytes(snapshot(cache), before)
    assert decode_writer(cfg, kernel.pool, kernel.layout, kernel.rings) is not None


def test_decode_write_refuses_float16_parameters_before_writing():
    """``decode_writer`` gives a float16 layout no writer; called directly, the compiled writes still refuse one
    (code 3) with nothing written, instead of storing float32 bytes where float16 parameters belong."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8)
    geo = build_geometry(cfg, page_size=16, num_kv_heads=H, head_dim=16, dtype=torch.float32)
    cache = Cache(geo, torch.float32, nblocks=16)
    kernel = decode_kernel(cfg, geo, "cpu", cache.pages, cache.rings)
    from kivi.attention.fused_cpu.kernel import _PL_PDT
    from kivi.paged.write_kernel import decode_write

    w = kernel.writer
    batch = cache.batch([(0, 17, 1)])
    k = torch.ones(1, H, 16)
    leave = torch.tensor([[0, -1, 0, 0]] * 8).numpy()  # one whole value group ...
    writes = torch.tensor([[0, 0, 0]]).numpy()  # ... and a ring write
    for code, want in ((2, 3), (0, 0)):
        lay = w.lay.copy()
        lay[_PL_PDT] = code
        before = snapshot(cache)
        rc = decode_write(w.pool, lay, w.krows, w.vrows, w.rbase, w.rstep, batch.ring_table.numpy(),
                          batch.page_table.numpy(), k.numpy(), k.numpy(), leave[:0], leave[:1], writes,
                          w.shrinks["k"], w.shrinks["v"])
        assert rc == want
        assert same_bytes(snapshot(cache), before) == (want == 3), code
