"""Real model: greedy tokens identical between the "cpu" and "reference" backends (slow)."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig, dequantize_model, quantize_model


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
            with torch.no_grad():
                outs[backend] = model.generate(ids, max_new_tokens=40, do_sample=False)
    finally:
        dequantize_model(model)
    assert torch.equal(outs["cpu"], outs["reference"])
