"""Real model: greedy decoding of the "cpu" and "reference" backends agrees (slow): logits within a
tolerance at every step, tokens equal up to a near-tie (the two backends sum in different orders)."""

from __future__ import annotations

import pytest

from kivi import KiviConfig, dequantize_model, quantize_model
from tests.helpers import assert_greedy_close, greedy

SMOLLM2_ATOL = 2e-3  # float32; SmolLM2's logits reach ~40, the backends differ by ~1e-4


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["extreme", "balanced"])
def test_smollm2_greedy_cpu_equals_reference(smollm2, preset):
    model, tok = smollm2
    prompt = "The history of the Roman Empire begins with " * 12  # > residual window: quantized history
    ids = tok(prompt, return_tensors="pt").input_ids
    outs = {}
    try:
        for backend in ("reference", "cpu"):
            quantize_model(model, KiviConfig.preset(preset, attention_backend=backend))
            outs[backend] = greedy(model, ids, new_tokens=40)
    finally:
        dequantize_model(model)
    assert_greedy_close(outs["cpu"], outs["reference"], atol=SMOLLM2_ATOL)
