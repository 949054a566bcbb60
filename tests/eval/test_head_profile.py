"""Per-head profile (kivi/eval/head_profile.py) on a tiny random model: scores, recommendation, budget."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.eval.head_profile import (
    _quantized,
    bits_per_element,
    head_profile,
    head_profile_prompts,
    recommend_head_bits,
)
from kivi.memory.sources import model_spec
from tests.helpers import tiny_model

BASE = KiviConfig(group_size=8, residual_length=16, block_size=32, sink_tokens=2)
MODEL = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2)


@pytest.fixture(scope="module")
def profile():
    model = tiny_model(**MODEL, weight_scale=2.0)
    windows = torch.randint(1, 128, (2, 96), generator=torch.Generator().manual_seed(0))
    return model, head_profile(model, windows, BASE, bits=(2, 4), prefix=40, progress=False)


def test_profile_scores_every_head_side(profile):
    model, prof = profile
    assert prof["num_layers"] == 2 and prof["num_kv_heads"] == 3 and len(prof["heads"]) == 2 * 3 * 2
    for r in prof["heads"]:
        assert r["score"]["2"] > r["score"]["4"] > 0  # wider codes perturb less, never nothing
    assert model.config._attn_implementation != "kivi_head_profile"  # restored


def test_quantized_keeps_sink_and_window_exact():
    x = torch.randn(61, 32)
    y = _quantized(x, "channel", 2, BASE)
    end = 2 + (61 - 16 - 2) // 8 * 8  # sink 2, whole key groups, then the window
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[end:], x[end:]) and not torch.equal(y[2:end], x[2:end])
    v = _quantized(x, "token", 2, BASE)
    assert torch.equal(v[61 - 16:], x[61 - 16:]) and not torch.equal(v[2:45], x[2:45])


def test_recommendation_spends_the_budget_on_the_worst_heads(profile):
    model, prof = profile
    spec = model_spec(model)
    plain = bits_per_element(spec, BASE, 4096)
    cfg, bits = recommend_head_bits(prof, spec, plain + 0.6, context=4096)
    assert plain < bits <= plain + 0.6
    assert bits == bits_per_element(spec, cfg, 4096)
    worst = max(prof["heads"], key=lambda r: r["score"]["2"] - r["score"]["4"])
    widths = cfg.layer_head_bits(worst["layer"])
    assert widths[0 if worst["side"] == "k" else 1][worst["head"]] == 4
    layer_cfg, layer_bits = recommend_head_bits(prof, spec, plain + 0.6, granularity="layer", context=4096)
    assert layer_cfg.head_bits == {} and layer_cfg.layer_specific_config and plain < layer_bits <= plain + 0.6
    with pytest.raises(ValueError, match=r"max_bits=1.0: the base config .* already needs"):
        recommend_head_bits(prof, spec, 1.0, context=4096)
    with pytest.raises(ValueError, match="granularity='tensor' is not allowed"):
        recommend_head_bits(prof, spec, 4.0, granularity="tensor")


def test_prompts_of_any_length_each_weigh_the_same(profile):
    model, _ = profile
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(1, 128, (1, 90), generator=g), torch.randint(1, 128, (1, 130), generator=g)
    prompts = [(a[0].tolist(), 70), (b[0].tolist(), 41)]
    both = head_profile_prompts(model, prompts, BASE, bits=(2, 4), progress=False)
    one = [head_profile(model, x, BASE, bits=(2, 4), prefix=f, progress=False) for x, f in ((a, 70), (b, 41))]
    assert both["protocol"] == {"prompts": 2, "tokens": 220, "scored": 20 + 89}
    for r, ra, rb in zip(both["heads"], one[0]["heads"], one[1]["heads"]):
        assert (r["layer"], r["head"], r["side"]) == (ra["layer"], ra["head"], ra["side"])
        for w in ("2", "4"):
            assert r["score"][w] == pytest.approx((ra["score"][w] + rb["score"][w]) / 2, rel=1e-12)
    alone = head_profile_prompts(model, prompts[:1], BASE, bits=(2, 4), progress=False)
    assert [r["score"] for r in alone["heads"]] == [r["score"] for r in one[0]["heads"]]
    cfg, _ = recommend_head_bits(both, model_spec(model), bits_per_element(model_spec(model), BASE, 4096) + 0.3,
                                 context=4096)
    assert cfg.head_bits  # a profile of prompts feeds the same recommendation


@pytest.mark.parametrize("prompts, message", [
    ([], "prompts is empty"),
    ([([1, 2, 3], 3)], r"prompts\[0\]: scored_from=3 must be in \[0, 3\)"),
    ([([1, 2, 3], 1), ([4, 5], -1)], r"prompts\[1\]: scored_from=-1"),
])
def test_bad_prompts(profile, prompts, message):
    with pytest.raises(ValueError, match=message):
        head_profile_prompts(profile[0], prompts, BASE, progress=False)
