"""kivi.paged.inputs_kernel: the batched decode kernel's inputs made in one compiled call equal the torch ones (row
ids of both sides, block-table rows, float32 query and new rows), and so do the outputs (no vLLM needed).

On the caches of ``tests/paged/test_decode_call.py`` (scattered blocks, every ring of a layer in one allocation,
other layers' pages between this layer's blocks so the ring pool's bases and steps are not trivial), steps of
decode rows, with sinks or without, float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from kivi.attention.fused_cpu.paged import RingRows
from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged.decode_call import decode_call, decode_kernel, paged_decode
from kivi.paged.forward import paged_step
from kivi.paged.geometry import build_geometry
from kivi.paged.plan import step_plan

from .test_decode_call import Cache, steps_of

pytestmark = pytest.mark.skipif(not numba_available(), reason="the paged decode kernel needs numba")

H, HQ, D, P = 2, 6, 16, 16


def _run_steps(cfg, geo, cache, backend, kernel, steps, rows_of, check) -> int:
    """Every step of ``steps``: the kernel call of its decode rows built twice (inputs made fast, then by the torch
    form), ``check(plan, fast, slow)`` on the two ``(PagedDecode, query)``, both run to equal outputs; then the
    step's writes (``paged_step``). The number of steps with decode rows."""
    checked = 0
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = rows_of(n)
        batch = cache.batch(rows)
        plan = step_plan(cfg, geo, batch.query_start, batch.seq_lens)
        if plan.kernel is not None:
            args = (kernel, plan.kernel, batch.page_table, batch.ring_table, q, k, v)
            fast, slow = decode_call(*args), decode_call(*args, compiled=False)
            check(plan, fast, slow)
            for a, b in zip(fast[0].__dict__.values(), slow[0].__dict__.values()):
                if not isinstance(a, (torch.Tensor, RingRows)):
                    assert a == b  # layout, w0, backend
            assert torch.equal(fast[0].counts, slow[0].counts) and torch.equal(fast[0].host_counts, plan.kernel.counts)
            got, want = paged_decode(*args, 0.25), paged_decode(*args, 0.25, compiled=False)
            assert got.dtype == want.dtype == q.dtype and torch.equal(got, want)
            checked += 1
        out = torch.empty(n, HQ, D, dtype=q.dtype)
        paged_step(cfg, geo, backend, q, k, v, cache.pages, cache.rings, batch, 0.25, out, kernel=kernel)
    return checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16),
                                 KiviConfig(k_bits=4, v_bits=2, group_size=8, residual_length=8, sink_tokens=3)],
                         ids=["k2v2", "k4v2-S3"])
def test_compiled_inputs_equal_the_torch_inputs(cfg, dtype):
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype)
    cache = Cache(geo, dtype, layers=3, layer=1)
    kernel = decode_kernel(cfg, geo, "cpu", cache.pages, cache.rings)
    assert kernel is not None and (kernel.rings.base != 0).any() and (kernel.rings.step != 1).any()
    g = torch.Generator().manual_seed(4)

    def check(plan, fast, slow):
        (fc, fq), (sc, sq) = fast, slow
        assert fq.dtype == torch.float32 and torch.equal(fq, sq.float())  # the queries
        assert torch.equal(fc.block_table, sc.block_table)  # block-table rows
        for a, b in ((fc.k_fp, sc.k_fp), (fc.v_fp, sc.v_fp)):  # both sides' row ids and new rows
            assert a.slots.dtype == torch.int32 and torch.equal(a.slots, b.slots)
            assert a.new.dtype == torch.float32 and torch.equal(a.new, b.new.float())

    steps = steps_of({0: 30, 1: 3, 2: 47, 3: 19, 4: 64}, late={5: (4, 21)}, decode_steps=30)
    rows_of = lambda n: [torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, H, H)]  # noqa: E731
    assert _run_steps(cfg, geo, cache, "cpu", kernel, steps, rows_of, check) >= 25


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_inputs_equal_the_torch_inputs(dtype):
    """The GPU path's inputs in one Triton launch (:func:`kivi.kernels.triton_paged_inputs.triton_paged_inputs`)
    equal the torch ones, value for value and in their dtype, and so do the outputs; the step's input rows are
    strided (channels contiguous, heads not: as vLLM's slices of its qkv projection)."""
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)
    cfg = KiviConfig(k_bits=4, v_bits=2, group_size=8, residual_length=8, sink_tokens=3)
    geo = build_geometry(cfg, page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype)
    cache = Cache(geo, dtype, layers=3, layer=1)
    kernel = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
    assert kernel is not None and kernel.backend == "triton" and (kernel.rings.base != 0).any()
    g = torch.Generator().manual_seed(5)

    def check(plan, fast, slow):
        (fc, fq), (sc, sq) = fast, slow
        assert fc.backend == "triton" and fc.host_counts is not None  # nothing read back from the device
        assert fq.dtype == dtype and torch.equal(fq, sq)  # the queries
        assert fc.block_table.dtype == torch.int32 and torch.equal(fc.block_table, sc.block_table)
        for a, b in ((fc.k_fp, sc.k_fp), (fc.v_fp, sc.v_fp)):  # both sides' row ids and new rows
            assert a.slots.dtype == torch.int32 and torch.equal(a.slots, b.slots)
            assert a.new.dtype == dtype and torch.equal(a.new, b.new)

    steps = steps_of({0: 30, 1: 3, 2: 47, 3: 19}, late={4: (3, 21)}, decode_steps=6)
    rows_of = lambda n: [torch.randn(n, h, 3 * D, generator=g).to(dtype)[..., D: 2 * D]  # noqa: E731
                         for h in (HQ, H, H)]
    assert _run_steps(cfg, geo, cache, "triton", kernel, steps, rows_of, check) >= 5
