import pytest

from kivi import KiviConfig
from kivi.eval.profile import layer_profile, only_layer_config, recommend_layer_config
from kivi.eval.sweep import candidate_grid, parse_percent, select_config, tune

ROWS = [
    {"name": "fp", "bits_per_element": 16.0, "ppl": 10.0, "delta_ppl_pct": 0.0},
    {"name": "4/4", "bits_per_element": 5.0, "ppl": 10.1, "delta_ppl_pct": 1.0},
    {"name": "4/2", "bits_per_element": 4.0, "ppl": 10.4, "delta_ppl_pct": 4.0},
    {"name": "2/4", "bits_per_element": 4.0, "ppl": 10.3, "delta_ppl_pct": 3.0},
    {"name": "2/2", "bits_per_element": 3.0, "ppl": 12.5, "delta_ppl_pct": 25.0},
    {"name": "quanto", "unavailable": "no quanto"},
]


def test_cheapest_within_ppl_budget():
    assert select_config(ROWS, max_ppl_increase=5.0)["name"] == "2/4"  # 4 bits; tie broken by quality
    assert select_config(ROWS, max_ppl_increase=1.0)["name"] == "4/4"
    assert select_config(ROWS, max_ppl_increase=30.0)["name"] == "2/2"
    assert select_config(ROWS, max_ppl_increase=0.0)["name"] == "fp"


def test_best_within_bits_budget():
    assert select_config(ROWS, max_bits=4.0)["name"] == "2/4"
    assert select_config(ROWS, max_bits=6.0)["name"] == "4/4"
    assert select_config(ROWS, max_bits=3.5)["name"] == "2/2"
    assert select_config(ROWS, max_bits=4.5, max_ppl_increase=3.5)["name"] == "2/4"


def test_nothing_fits():
    with pytest.raises(ValueError, match="no candidate fits"):
        select_config(ROWS, max_bits=2.0)
    with pytest.raises(ValueError, match="budget"):
        select_config(ROWS)


def test_parse_percent():
    assert parse_percent("5%") == 5.0 and parse_percent("2.5") == 2.5
    with pytest.raises(ValueError):
        parse_percent("five")
    with pytest.raises(ValueError):
        parse_percent("-1%")


def test_only_layer_config():
    c = only_layer_config(KiviConfig.preset("extreme"), 1)
    assert not c.for_layer(0).quantize_key and not c.for_layer(0).quantize_value
    l1 = c.for_layer(1)
    assert l1.quantize_key and l1.quantize_value and l1.k_bits == 2


def test_profile_and_recommendation(peaked_model, windows, tmp_path):
    prof = layer_profile(peaked_model, windows, prefix=64, chunk=16, progress=False)
    assert [r["layer"] for r in prof["layers"]] == [0, 1]
    assert sorted(prof["ranking"]) == [0, 1] and all(r["kl"] >= 0 for r in prof["layers"])
    rec = recommend_layer_config(prof, num_layers=1)
    assert rec.layer_specific_config == {prof["ranking"][0]: {"k_bits": 4}}
    path = tmp_path / "rec.json"
    rec.to_json(path)
    assert KiviConfig.from_json(path) == rec
    big = recommend_layer_config(prof, max_bits=100.0, model=peaked_model, tokens=192, prefix=64)
    assert len(big.layer_specific_config) == 2
    with pytest.raises(ValueError):
        recommend_layer_config(prof, max_bits=0.1, model=peaked_model, tokens=192, prefix=64)
    assert len(candidate_grid(prof)) > len(candidate_grid())


def test_tune_end_to_end(peaked_model, windows):
    cands = [KiviConfig.preset("high", residual_length=32), KiviConfig(residual_length=32),
             KiviConfig(k_bits=1, v_bits=1, residual_length=0)]
    r = tune(peaked_model, windows, cands, max_ppl_increase=1000.0, prefix=64, chunk=16, progress=False)
    # the cheapest candidate fits a huge budget, and it is the only one measured
    assert r["config"]["k_bits"] == 1 and len(r["evaluated"]) == 1
    r = tune(peaked_model, windows, cands, max_bits=64, prefix=64, chunk=16, progress=False)
    assert len(r["evaluated"]) == 3  # a bits budget measures every candidate under it
    best = min(r["evaluated"], key=lambda x: x["delta_ppl_pct"])
    assert r["ppl"] == best["ppl"]
    KiviConfig.from_dict(r["config"])
