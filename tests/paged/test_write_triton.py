"""kivi.kernels.triton_paged_write: a decode-only step's writes in Triton (the GPU path's) leave the pages and rings
bit for bit as the torch writes do; CPU tensors under ``TRITON_INTERPRET=1`` (no vLLM needed).

Two copies of a vLLM-style cache (:class:`tests.paged.test_decode_call.Cache`: scattered blocks, rings in one
allocation that start as NaN) run the same steps through ``paged_step`` with the ``"triton"`` reader, one with the
Triton writes (the default where :func:`kivi.paged.write.triton_writer` applies) and one with
``compiled_writes=False`` (the torch writes, the reference): after every step both caches are byte-identical and
the outputs equal, over widths 1 / 2 / 4 / 8 on either side, group sizes 4 / 8 / 16, head sizes 16 / 32, windows of
1 or 2 groups, sinks, float32 and bfloat16 rings, float32 parameters for bfloat16 rings, tiny to large magnitudes
and all-constant groups. A non-finite leaving value writes nothing (read back at once, or once per step).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kivi.config import KiviConfig
from kivi.paged.decode_call import decode_kernel
from kivi.paged.forward import paged_step
from kivi.paged.geometry import build_geometry
from kivi.paged.write import FiniteChecks, TritonWriter

from .test_decode_call import Cache, steps_of
from .test_write import counting, run_pair, snapshot

pytestmark = pytest.mark.triton

H, HQ = 2, 4


@pytest.fixture(autouse=True)
def _interpreter():
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)


CASES = [  # (k_bits, v_bits, G, D, R, sink, dtype, scale_dtype, magnitude)
    (2, 2, 8, 16, 16, 0, torch.float32, "auto", 1.0),
    (4, 2, 8, 32, 8, 3, torch.bfloat16, "auto", 300.0),
    (1, 8, 4, 16, 8, 1, torch.bfloat16, "float32", 1e-3),
    (8, 4, 16, 32, 16, 0, torch.float32, "auto", 1.0),
]


@pytest.mark.parametrize("k_bits, v_bits, G, D, R, sink, dtype, scale_dtype, mag", CASES,
                         ids=["k2v2-G8", "k4v2-G8-S3-bf16-large", "k1v8-G4-S1-bf16-fp32params-tiny", "k8v4-G16"])
def test_triton_writes_equal_the_torch_writes(k_bits, v_bits, G, D, R, sink, dtype, scale_dtype, mag, monkeypatch):
    cfg = KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R, sink_tokens=sink,
                     scale_dtype=scale_dtype, block_size=4 * G)
    # every decode row holds stored tokens (a row with none attends exactly, request by request): the steps
    # without a prefill or chunk are decode-only, and take the Triton writes
    prompts = {0: R + G + 3, 1: R + 2 * G + 1, 2: R + 5 * G - 1, 3: R + sink + 1}
    # two key groups leave each window at G <= 8; one at G = 16 (its 36 interpreted steps took ~50 s, 20 take ~25)
    steps = steps_of(prompts, late={4: (2, R + G + 3)}, decode_steps=2 * G + 4 if G <= 8 else G + 4)
    calls = counting(monkeypatch)
    run_pair(cfg, dtype, D, 2 * G, steps, mag=mag, constant={5, 6}, backend="triton", nblocks=48)
    assert len(calls) >= len(steps) // 2, f"only {len(calls)} of {len(steps)} steps took the Triton writes"


@pytest.mark.parametrize("deferred", [False, True], ids=["read-back-at-once", "read-back-once-per-step"])
def test_a_non_finite_leaving_value_writes_nothing(deferred):
    """The torch writes refuse it when it leaves the window; the Triton writes refuse it at the same step, with the
    pages and rings as they were. ``deferred`` (the plugin's GPU path): the layer's flag is only appended to the
    step's :class:`FiniteChecks`, nothing is raised until the step's last layer has run, and then the error names
    the layer."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=4, residual_length=4)
    geo = build_geometry(cfg, page_size=8, num_kv_heads=H, head_dim=16, dtype=torch.float32)
    cache = Cache(geo, torch.float32, nblocks=16)
    kernel = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
    assert isinstance(kernel.writer, TritonWriter)
    g = torch.Generator().manual_seed(0)
    steps = steps_of({0: 9}, late={}, decode_steps=12)
    for s, rows in enumerate(steps):
        n = sum(q for _, _, q in rows)
        q, k, v = torch.randn(n, HQ, 16, generator=g), torch.randn(n, H, 16, generator=g), torch.randn(n, H, 16)
        if s == 1:
            v[0, 1, 3] = float("nan")  # enters the window now, leaves it R steps later
        batch = cache.batch(rows)
        refused = s == 1 + cfg.residual_length
        checks = FiniteChecks(layers=2 if refused else 1) if deferred else None

        step = functools.partial(paged_step, cfg, geo, "triton", q, k, v, cache.pages, cache.rings, batch, 0.25,
                                 torch.empty(n, HQ, 16), kernel=kernel, flags=None if checks is None else checks.flags)

        if not refused:
            step()
            if checks is not None:
                checks.layer_ran("layers.0")  # a finite step's flags read back clear
            continue
        before = snapshot(cache)
        if deferred:
            step()
            assert len(checks.flags) == 1
            checks.layer_ran("layers.0")  # not the step's last layer: nothing read back yet
            with pytest.raises(ValueError, match=r"NaN or Inf.*in layers\.0,"):
                checks.layer_ran("layers.1")
            assert checks.flags == [] and checks.names == []
        else:
            with pytest.raises(ValueError, match="NaN or Inf"):
                step()
        after = snapshot(cache)
        assert torch.equal(before[0], after[0]), "a refused step wrote the pages"
        assert all(torch.equal(a.view(torch.float32).nan_to_num(7), b.view(torch.float32).nan_to_num(7))
                   for a, b in zip(before[1], after[1])), "a refused step wrote the rings"
        return
    raise AssertionError("the NaN never left the window")


def test_where_the_triton_writes_apply():
    geo_args = dict(page_size=16, num_kv_heads=H, head_dim=16, dtype=torch.float32)
    for cfg, applies in ((KiviConfig(k_bits=2, v_bits=4, group_size=8, residual_length=8), True),
                         (KiviConfig(k_bits=3, v_bits=2, group_size=8, residual_length=8), False),  # 3-bit packing
                         (KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, clip=True), False),
                         (KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, symmetric=True), False),
                         (KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, check_finite=False), False)):
        geo = build_geometry(cfg, **geo_args)
        cache = Cache(geo, torch.float32, nblocks=8)
        kernel = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
        assert kernel is not None and isinstance(kernel.writer, TritonWriter) == applies, cfg


def test_flags_a_step_left_unread_are_read_at_close():
    """A step in which fewer layers reported than the group counts (``layers``) leaves flags unread; ``close`` (the
    builder calls it before the next step) reads them: a set flag is raised naming the layers around it, clear
    flags pass, and nothing is read twice."""
    checks = FiniteChecks(layers=4)
    checks.flags.append(torch.zeros(1, dtype=torch.int64))
    checks.layer_ran("layers.0")
    checks.flags.append(torch.ones(1, dtype=torch.int64))  # layers.1 refused its write, then never reported
    with pytest.raises(ValueError, match=r"NaN or Inf.*in a layer that did not report \(after layers\.0\)"):
        checks.close()
    assert checks.flags == [] and checks.names == []
    checks.close()  # nothing left: no error
    clear = FiniteChecks(layers=4)
    clear.flags.append(torch.zeros(1, dtype=torch.int64))
    clear.layer_ran("layers.0")
    clear.close()
    assert clear.flags == []
