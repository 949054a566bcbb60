"""The transforms screened by benchmarks/compensation_study.py do what their names say."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compensation_study.py"
spec = importlib.util.spec_from_file_location("compensation_study", _PATH)
cs = importlib.util.module_from_spec(spec)
sys.modules["compensation_study"] = cs  # dataclasses resolve their module by name
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


# ---- issue 12 item 4: the composable quantizer (Spec / Recipe) -----------------------------------


def test_uniform_spec_matches_kivi_reference(kv):
    """Default Spec = KIVI: keys per channel, values per token, same grid up to fp16 parameters."""
    k, v = kv
    k2, v2 = cs.plain(2, 2)(k, v)
    ks = cs.quantize_spec(k, cs.Spec(2, "channel"))
    vs = cs.quantize_spec(v, cs.Spec(2, "token"))
    for got, ref, x, axis in ((ks, k2, k, -2), (vs, v2, v, -1)):
        xg, red = cs._grouped(x, axis)
        step = ((xg.amax(red, keepdim=True) - xg.amin(red, keepdim=True)) / 3).expand_as(xg).reshape(x.shape)
        big = xg.abs().amax(red, keepdim=True).expand_as(xg).reshape(x.shape)
        off = (got - ref).abs() > 2**-9 * big + 1e-4  # fp16-rounded lo/range only ...
        assert off.float().mean() < 1e-3  # ... except values at a rounding boundary: one step apart
        assert ((got - ref).abs()[off] <= 1.01 * step[off] + 2**-9 * big[off]).all()
        assert ((got - x).abs() <= 0.51 * step + 1e-3).all()


def test_clip_and_lloyd_never_worse_than_uniform_per_group(kv):
    k, _ = kv
    for per, axis in (("channel", -2), ("token", -1)):
        base = cs.quantize_spec(k, cs.Spec(2, per))
        for spec in (cs.Spec(2, per, clip=True), cs.Spec(2, per, levels="nf", clip=True)):
            got = cs.quantize_spec(k, spec)
            eg, red = cs._grouped((got - k) ** 2, axis)
            assert torch.isfinite(got).all()
            if spec.levels == "uniform":  # ratio 1.0 is among the tries: per group never worse
                eb, _ = cs._grouped((base - k) ** 2, axis)
                assert (eg.sum(red) <= eb.sum(red) + 1e-4).all()
    nf = cs.quantize_spec(k, cs.Spec(2, "token", levels="nf"))
    nfc = cs.quantize_spec(k, cs.Spec(2, "token", levels="nf", clip=True))
    assert _err(nfc, k) <= _err(nf, k)


def test_lloyd_levels_reference_values():
    g = torch.Generator().manual_seed(1)
    centers = torch.tensor([-3.0, -1.0, 0.5, 4.0])
    x = centers[torch.randint(0, 4, (4000,), generator=g)] + 0.01 * torch.randn(4000, generator=g)
    assert torch.allclose(cs.lloyd_levels(x, 4), centers, atol=0.02)
    # Max (1960): 2-bit Lloyd-Max levels of N(0,1) are ±0.4528, ±1.510
    assert torch.allclose(cs.normal_levels(2), torch.tensor([-1.510, -0.4528, 0.4528, 1.510]), atol=0.015)


def test_hadamard_rotation_is_folded_exactly(kv):
    k, v = kv
    h = cs.hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    with pytest.raises(ValueError, match="head_dim=48"):
        cs.hadamard(48)
    spec = cs.Spec(2, "token", rotate=True)
    got = cs.quantize_spec(v, spec)
    manual = cs.quantize_spec(v @ h, cs.Spec(2, "token")) @ h.T
    assert torch.allclose(got, manual, atol=1e-5)
    # attention folds the inverse: softmax(A) (V_hat) == (softmax(A) (V H)_hat) H^T
    p = torch.softmax(torch.randn(1, 2, 5, 96), -1)
    assert torch.allclose(p @ got, (p @ cs.quantize_spec(v @ h, cs.Spec(2, "token"))) @ h.T, atol=1e-5)
    assert _err(got, v) < 2 * _err(cs.quantize_spec(v, cs.Spec(2, "token")), v)


def test_outliers_and_sinks_are_exact_with_fixed_counts(kv):
    k, _ = kv
    for per, axis in (("channel", -2), ("token", -1)):
        got = cs.quantize_spec(k, cs.Spec(2, per, outliers=1), sinks=0)
        eg, red = cs._grouped((got == k.half().float()), axis)
        assert (eg.sum(red) >= 1).all()  # the farthest-from-median entry of every group is exact
    spec = cs.Spec(2, "channel", outliers=0.01)
    mask = cs._exact_mask(k, spec, 0, -2)
    assert (mask.reshape(1, 2, 3, -1).sum(-1) == round(0.01 * 32 * 64)).all()
    assert _err(cs.quantize_spec(k, spec), k) < _err(cs.quantize_spec(k, cs.Spec(2, "channel")), k)
    s = cs.quantize_spec(k, cs.Spec(2, "channel"), sinks=4)
    assert torch.equal(s[:, :, :4], k[:, :, :4].half().float())


def test_recipe_bits_count_every_extra():
    T, D = 896, 64
    assert cs.Spec(2).bits_per_element(T, D) == 3.0
    assert cs.Spec(2, outliers=1).bits_per_element(T, D) == 3.0 + 24 / 32
    assert cs.Spec(2, outliers=0.01).bits_per_element(T, D) == 3.0 + 20 * 32 / (32 * 64)
    assert 3.0 < cs.Spec(2, levels="lloyd").bits_per_element(T, D) < 3.001
    r = cs.Recipe(cs.Spec(3, "channel"), cs.Spec(3, "token", rotate=True), sinks=4)
    assert math.isclose(r.bits(T, D), 4.0 + 4 * 16 / T)
    names = [n for n, _ in cs.beyond_kivi()]
    assert len(names) == len(set(names))


def test_fp16_params_cost_precision_on_offset_channels():
    """A channel with a large offset and a small range: fp16 rounding of the offset moves every value."""
    g = torch.Generator().manual_seed(2)
    k = 200 + 0.02 * torch.randn(1, 1, 64, 8, generator=g)
    e32 = _err(cs.quantize_spec(k, cs.Spec(2, "channel")), k)
    e16 = _err(cs.quantize_spec(k, cs.Spec(2, "channel", fp16_params=True)), k)
    assert e16 > 1.5 * e32


def test_frontier_interpolation_and_merge(tmp_path):
    rows = [{"name": "K2V2 (KIVI)", "bits": 3.0, "dppl": 100.0}, {"name": "K3V2", "bits": 3.5, "dppl": 25.0},
            {"name": "K3V3", "bits": 4.0, "dppl": 8.0}, {"name": "K4V2", "bits": 4.0, "dppl": 18.0},
            {"name": "other", "bits": 3.2, "dppl": 1.0}]
    front = cs.frontier(rows)
    assert front == [(3.0, 100.0), (3.5, 25.0), (4.0, 8.0)]  # best plain codes per width only
    assert math.isclose(cs.at_bits(front, 3.25), 50.0)  # log-linear: geometric mean halfway
    assert cs.at_bits(front, 4.5) is None
    import json
    run = {"protocol": "p", "model": "m", "windows": 4, "context": 1024, "residual_length": 128, "group_size": 32,
           "tokens_scored": 10, "command": "x", "rows": [{"name": "fp", "bits": 16, "ppl": 10.0, "kl": 0},
                                                        {"name": "K2V2 (KIVI)", "bits": 3.0, "ppl": 20.0, "kl": 1}]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run))
    b.write_text(json.dumps({**run, "rows": [{**run["rows"][0], "ppl": 11.0}]}))
    out = cs.merge([str(a)], str(tmp_path / "t.md"))
    assert out["rows"][1]["dppl"] == 100.0 and "| K2V2 (KIVI) | 3.000 | 20.00 | +100.0 |" in (tmp_path / "t.md").read_text()
    with pytest.raises(ValueError, match="not the same protocol"):
        cs.merge([str(a), str(b)], None)
