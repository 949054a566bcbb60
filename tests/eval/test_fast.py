"""The fast evaluation (shared FP prefill, packed attention, 512-token forwards) against the reference one.

Tolerance: the fast mode changes only the order of float operations (blocked attention instead of
dequantize-then-SDPA; one forward of n tokens instead of n/16 forwards, i.e. other matmul shapes), so
FP results agree to float32 rounding (rel 1e-5). A quantized cache amplifies a rounding difference
when it moves a key or value across a code boundary (a 2-bit code is a quarter of the group's range),
so quantized configs get rel 1e-4 on the mean NLL and 1e-3 (abs 1e-5) on KL — still two orders of
magnitude below the smallest difference between configs the tools rank (K4V4 vs K4V2: ~1e-2).
The prefill replay is exact: the same tensors go into the same cache (torch.equal).
"""

from __future__ import annotations

import pytest
import torch

from kivi.config import KiviConfig
from kivi.eval import compare, make_cache
from kivi.eval.stream import chunk_neutral, run_prefill, stream_window
from kivi.eval.sweep import tune
from tests.helpers import recording_bar

CONFIGS = [KiviConfig(residual_length=32), KiviConfig.preset("balanced", residual_length=32),
           KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=0, sink_tokens=3)]
IDS = ["k2v2-R32", "balanced-R32", "k4v4-G16-R0-sink3"]


@pytest.fixture(scope="module")
def odd_windows():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (2, 157), generator=g)  # 157 - 61: not a multiple of any group size


@pytest.mark.parametrize("cfg", [pytest.param(CONFIGS[0], marks=pytest.mark.slow),
                                 pytest.param(CONFIGS[1], marks=pytest.mark.slow), CONFIGS[2]], ids=IDS)
def test_prefill_replay_is_exact(peaked_model, odd_windows, cfg):
    ids = odd_windows[:1]
    pre = run_prefill(peaked_model, ids, 61)
    assert pre is not None and len(pre.states) == 2
    for read_packed in (False, True):
        a = list(stream_window(peaked_model, ids, make_cache(peaked_model, cfg, read_packed=read_packed), 61, 16))
        b = list(stream_window(peaked_model, ids, make_cache(peaked_model, cfg, read_packed=read_packed), 61, 16, pre))
        assert len(a) == len(b)
        for (la, ta), (lb, tb) in zip(a, b):
            assert torch.equal(ta, tb) and torch.equal(la, lb)


def test_fast_caches_read_the_packed_backend(peaked_model):
    c = make_cache(peaked_model, KiviConfig(), read_packed=True)
    assert c.attention_backend == "cpu" and chunk_neutral(c)
    assert make_cache(peaked_model, KiviConfig()).attention_backend == "reference"  # unchanged default
    assert (
        make_cache(peaked_model, KiviConfig(attention_backend="reference"), read_packed=True).attention_backend
        == "reference"
    )
    assert peaked_model.config._attn_implementation != "kivi"  # restored


def test_fast_equals_reference(peaked_model, odd_windows):
    a = compare(peaked_model, odd_windows, CONFIGS, prefix=61, chunk=16, progress=False, fast=False)
    b = compare(peaked_model, odd_windows, CONFIGS, prefix=61, chunk=16, progress=False, fast=True)
    assert b["fp"]["nll"] == pytest.approx(a["fp"]["nll"], rel=1e-5)
    for ra, rb in zip(a["results"], b["results"]):
        assert rb["tokens_scored"] == ra["tokens_scored"] and rb["windows"] == ra["windows"] == 2
        assert rb["nll"] == pytest.approx(ra["nll"], rel=1e-4)
        assert rb["kl"] == pytest.approx(ra["kl"], rel=1e-3, abs=1e-5)
        assert rb["top1_agreement"] == pytest.approx(ra["top1_agreement"], abs=2 / ra["tokens_scored"])
        assert rb["kl"] > 1e-4  # quantization shows: the comparison is not between two FP runs


def test_progress_bar_names_config_and_window(peaked_model, odd_windows, monkeypatch):
    seen = []

    import kivi.eval.comparison as stream  # compare() runs the bar

    monkeypatch.setattr(stream, "progress_bar", recording_bar(seen))
    compare(peaked_model, odd_windows, [CONFIGS[0]], prefix=61, chunk=16)
    assert "fp · window 1/2" in seen and f"{CONFIGS[0].describe()} · window 2/2" in seen
    assert seen[-1] == ("done", 4 * 96, 4 * 96)  # 2 windows x (fp + 1 config) x 96 scored tokens


def test_tune_fast_picks_as_reference_and_stops_early(peaked_model, model_text):
    # On these windows K2V2 R0 is ~+20 % and K4V4 R0 ~+1.1 % (measured): a 2 % budget separates them.
    cands = [KiviConfig(k_bits=2, v_bits=2, residual_length=0), KiviConfig(k_bits=4, v_bits=4, residual_length=0)]
    slow = tune(peaked_model, model_text, cands, max_ppl_increase=2.0, prefix=64, fast=False, early_stop=None,
                progress=False)
    fast = tune(peaked_model, model_text, cands, max_ppl_increase=2.0, prefix=64, progress=False)
    assert fast["name"] == slow["name"] == cands[1].describe()
    assert fast["delta_ppl_pct"] == pytest.approx(slow["delta_ppl_pct"], abs=0.01)
    two_bit = [r for r in fast["evaluated"] if r["name"] == cands[0].describe()][0]
    assert "stopped_early" in two_bit and two_bit["windows"] == 1  # far over 2 x 2 %: one window was enough
    assert "stopped_early" not in slow["evaluated"][0] and slow["evaluated"][0]["windows"] == 2


def test_eval_modules_import_no_private_names_of_each_other():
    """Each evaluation module uses its siblings' public names only (the accumulator is ``metrics.Accumulator``)."""
    import ast
    from pathlib import Path

    import kivi.eval

    found = []
    for path in Path(kivi.eval.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert found == []
