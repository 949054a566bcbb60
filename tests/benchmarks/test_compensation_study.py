"""The transforms screened by benchmarks/compensation_study.py do what their names say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compensation_study.py"
spec = importlib.util.spec_from_file_location("compensation_study", _PATH)
cs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cs)


@pytest.fixture
def kv():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 96, 64, generator=g)
    k[:, :, 0] *= 30  # outlier first token
    return k, torch.randn(1, 2, 96, 64, generator=g)


def _err(a, b):
    return (a - b).pow(2).mean().item()


def test_corrections_reduce_error_and_sinks_are_exact(kv):
    k, v = kv
    k2, v2 = cs.plain(2, 2)(k, v)
    for fn in (cs.group_mean, cs.sign_residual(True), cs.low_rank(4, 4), cs.sinks(1), cs.clipped()):
        kc, vc = fn(k, v)
        assert kc.shape == k.shape and vc.shape == v.shape
        assert _err(kc, k) + _err(vc, v) < _err(k2, k) + _err(v2, v)
    ks, vs = cs.sinks(1)(k, v)
    assert torch.equal(ks[:, :, :1], k[:, :, :1]) and torch.equal(vs[:, :, :1], v[:, :, :1])
    kf, _ = cs.low_rank(64, 0)(k, v)  # full rank: only the fp16 rounding of the factors remains
    assert _err(kf, k) < 1e-5


def test_candidate_bits_are_ordered(kv):
    rows = {name: bits for name, bits, _ in cs.candidates(896, 64)}
    assert rows["K2V2 (KIVI)"] == 3.0  # 2-bit codes + fp16 scale and zero-point per 32
    assert rows["K3V2"] == 3.5 and rows["K3V3"] == 4.0 and rows["K2V2 + MSE clipping"] == 3.0
    assert rows["K2V2 + low-rank K r1"] < rows["K2V2 + low-rank K r2"] < rows["K2V2 + low-rank K r4"]
