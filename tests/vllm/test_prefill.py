"""kivi.vllm.prefill: a step's exact prefills through vLLM's CPU attention kernel equal the torch SDPA
reference (:func:`kivi.paged.forward.sdpa_prefill`) to rounding and write only their spans; the engine tests
(test_greedy.py) run the plugin with it."""

from __future__ import annotations

import pytest
import torch

from kivi.paged.forward import sdpa_prefill

pytestmark = pytest.mark.vllm

HQ, H = 9, 3  # SmolLM2's grouped heads
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _rows(n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(dtype) for h in (HQ, H, H)]


def compare_prefill(prefill, q, k, v, spans, scale, tol):
    """``prefill`` (an exact prefill: ``(q, k, v, spans, scale, out)``) against :func:`sdpa_prefill`: equal to
    ``tol`` relative to the largest output inside the spans, and the rows outside them left as they were."""
    n, d = q.shape[0], q.shape[2]
    got = torch.full((n, HQ, d), float("nan"), dtype=q.dtype)
    want = got.clone()
    prefill(q, k, v, spans, scale, got)
    sdpa_prefill(q, k, v, spans, scale, want)
    inside = torch.zeros(n, dtype=torch.bool)
    for lo, hi in spans:
        inside[lo:hi] = True
    assert got[~inside].isnan().all()  # rows outside the spans (decode rows, later chunks) untouched
    assert not got[inside].isnan().any()
    err = (got[inside].float() - want[inside].float()).abs().max().item()
    assert err <= tol * max(1.0, want[inside].float().abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("spans", [[(0, 1)], [(0, 31), (31, 64), (64, 97)], [(3, 40), (41, 150), (152, 153)],
                                   [(0, 300)]])
def test_vllm_kernel_equals_sdpa(dtype, d, spans):
    from kivi.vllm.prefill import vllm_cpu_prefill

    q, k, v = _rows(spans[-1][1] + 2, d, dtype, seed=len(spans) * d)
    compare_prefill(vllm_cpu_prefill, q, k, v, spans, d ** -0.5, TOL[dtype])


def test_constant_keys_and_a_long_prompt():
    """All-equal keys (softmax over ties) and a prompt over many scratch blocks."""
    from kivi.vllm.prefill import vllm_cpu_prefill

    n, d = 1000, 64
    q, _, v = _rows(n, d, torch.float32, seed=7)
    k = torch.full((n, H, d), 0.5)
    got, want = torch.empty(n, HQ, d), torch.empty(n, HQ, d)
    vllm_cpu_prefill(q, k, v, [(0, 517), (517, n)], 0.125, got)
    sdpa_prefill(q, k, v, [(0, 517), (517, n)], 0.125, want)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_unsupported_head_size_is_refused_by_name():
    from kivi.vllm.backend import _exact_prefill

    assert _exact_prefill("reference", 16, torch.float32) is sdpa_prefill
    with pytest.raises(NotImplementedError, match="head size 16"):
        _exact_prefill("cpu", 16, torch.float32)
