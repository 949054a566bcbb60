"""benchmarks/run_eval_suite.py --weight-bits: results of `compare` on separate windows merge into the result
of one `compare` over all of them (the weights suite runs window by window, every width in turn)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kivi import KiviConfig
from kivi.eval import compare

from tests.helpers import tiny_model

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "run_eval_suite.py"
spec = importlib.util.spec_from_file_location("run_eval_suite", _PATH)
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)


def test_merged_windows_equal_one_compare_over_all_windows():
    model = tiny_model("llama", weight_scale=4.0)
    windows = torch.randint(1, 128, (3, 160), generator=torch.Generator().manual_seed(0))
    specs = [KiviConfig(residual_length=32, block_size=64), KiviConfig(k_bits=4, v_bits=2, residual_length=32)]
    kw = dict(prefix=96, chunk=16, progress=False)
    whole = compare(model, windows, specs, **kw)
    merged = suite.merge_windows([compare(model, windows[i : i + 1], specs, **kw) for i in range(3)])
    assert merged["protocol"]["windows"] == whole["protocol"]["windows"] == 3
    assert merged["protocol"]["windows_requested"] == 3
    for a, b in zip([merged["fp"], *merged["results"]], [whole["fp"], *whole["results"]]):
        assert a["tokens_scored"] == b["tokens_scored"] and a["windows"] == b["windows"]
        assert a["cache_bytes"] == b["cache_bytes"]
        for key in ("ppl", "nll", "bits_per_element", "kl", "top1_agreement", "delta_ppl_pct"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
    assert "weights" in suite.suites()
