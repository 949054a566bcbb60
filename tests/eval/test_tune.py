"""`tune` (kivi/eval/sweep.py) over the new search space: bits counted by the planner at a long context,
tiers only where their bits and quality describe the same cache, per-head mixes from a profile pass on
other windows, and a progress bar that names what it measures."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.eval.head_profile import bits_per_element
from kivi.eval.sweep import tune
from kivi.memory.sources import model_spec
from tests.helpers import recording_bar

FAST = dict(prefix=64, chunk=16, progress=False)
# at 32K tokens A (2-bit, R32) is far cheaper than B (4-bit, no window); at the end of a 192-token window in
# the fp32 model, A's 32 full-precision tokens make it the dearer one
A = KiviConfig(k_bits=2, v_bits=2, residual_length=32)
B = KiviConfig(k_bits=4, v_bits=4, residual_length=0)


def test_bits_at_ranks_by_the_planner_and_reports_both(peaked_model, windows):
    spec = model_spec(peaked_model, dtype="float16")
    long = tune(peaked_model, windows, [B, A], max_ppl_increase=1e6, **FAST)
    assert long["name"] == A.describe() and long["bits_basis"].startswith("planner, float16 model, 32768")
    assert long["bits_per_element"] == long["bits_planner"] == bits_per_element(spec, A, 32768)
    assert long["bits_at_eval"] > B.k_bits + 1  # what the fp32 cache held at 192 tokens: the window weighs
    held = tune(peaked_model, windows, [B, A], max_ppl_increase=1e6, bits_at=None, **FAST)
    assert held["name"] == B.describe() and held["bits_per_element"] == held["bits_at_eval"]
    assert held["bits_planner"] == bits_per_element(spec, B, 32768)  # reported, not ranked by
    r = tune(peaked_model, windows[:1], [B, A], max_bits=4.0, **FAST)  # a bits budget in the same definition
    assert [x["name"] for x in r["evaluated"]] == [A.describe()]
    with pytest.raises(ValueError, match="bits_at"):
        tune(peaked_model, windows, [A], max_bits=4.0, bits_at=0, **FAST)


def test_tiers_are_measured_only_when_bits_are_counted_within_the_windows(peaked_model, windows):
    tiered = KiviConfig(k_bits=4, v_bits=4, residual_length=32, tiers=[(32, None), (32, 4), (None, 2)])
    windows = windows[:1]
    r = tune(peaked_model, windows, [tiered, A], max_bits=1e6, **FAST)
    assert [x["name"] for x in r["evaluated"]] == [A.describe()]
    assert any("position tiers" in s["reason"] and s["name"] == tiered.describe() for s in r["skipped"])
    assert r["search"]["tiers"].startswith("not searched")
    for bits_at in (None, 192):
        r = tune(peaked_model, windows, [tiered, A], max_bits=1e6, bits_at=bits_at, **FAST)
        assert tiered.describe() in [x["name"] for x in r["evaluated"]] and r["search"]["tiers"] == "searched"
    grid = tune(peaked_model, windows, None, max_ppl_increase=1e6, bits_at=192, **FAST)
    assert grid["search"]["tiers"] == "searched" and grid["search"]["ranked"] > 0


def test_per_head_candidates_come_from_a_profile_of_other_windows(peaked_model, windows, monkeypatch):
    import kivi.eval.head_profile as hp

    seen = []
    real = hp.head_profile

    def spy(model, wins, base, **kw):
        seen.append((wins.clone(), base))
        return real(model, wins, base, **kw)

    monkeypatch.setattr(hp, "head_profile", spy)
    other = torch.randint(0, 256, (1, 192), generator=torch.Generator().manual_seed(9))
    bases = [KiviConfig(k_bits=2, v_bits=2, residual_length=32, sink_tokens=4),
             KiviConfig(k_bits=4, v_bits=2, residual_length=32, sink_tokens=4)]
    spec = model_spec(peaked_model, dtype="float16")
    budget = bits_per_element(spec, bases[0], 32768) + 0.6
    r = tune(peaked_model, windows[:1], [A], max_bits=budget, profile_windows=other, head_bases=bases,
             head_steps=(0.25,), **FAST)
    assert len(seen) == 1 and torch.equal(seen[0][0], other)  # one pass (same G, R, sinks), on the other windows
    heads = [x for x in r["evaluated"] if x["config"]["head_bits"]]
    # K2V2 at +0.25 bits and at max_bits, K4V2 at +0.25 (over max_bits: generated, not measured)
    assert r["search"]["per_head"] == 3 and len(heads) == 2
    base_bits = bits_per_element(spec, bases[0], 32768)
    assert all(base_bits < x["bits_per_element"] <= budget and "head-sides widened" in x["name"] for x in heads)
    assert min(x["bits_per_element"] for x in heads) <= base_bits + 0.25
    assert r["protocol"]["profile_windows"] == 1 and r["seconds"]["profile"] >= 0


def test_progress_names_the_fp_reference_and_each_candidate(peaked_model, windows, monkeypatch):
    seen = []

    import kivi.eval.tuning as sweep  # tune() runs the bar

    monkeypatch.setattr(sweep, "progress_bar", recording_bar(seen))
    tune(peaked_model, windows, [A, B], max_bits=1e6, prefix=64, chunk=16)
    assert "fp · FP reference, window 2/2" in seen
    assert f"{A.describe()} · candidate 1/2, window 1/2" in seen
    assert f"{B.describe()} · candidate 2/2, window 2/2" in seen
    assert seen[-1] == ("done", 3 * 2 * 128, 3 * 2 * 128)


def test_nothing_fits_raises_with_the_measured_rows(peaked_model, windows):
    from kivi.eval.sweep import NoCandidateFits

    one_bit = KiviConfig(k_bits=1, v_bits=1, residual_length=0)
    with pytest.raises(NoCandidateFits, match="no candidate fits") as e:
        tune(peaked_model, windows[:1], [one_bit], max_ppl_increase=0.0, **FAST)
    rows = e.value.result["evaluated"]
    assert [r["name"] for r in rows] == [one_bit.describe()] and rows[0]["delta_ppl_pct"] > 0
    assert "config" not in e.value.result and e.value.result["ppl_fp"] > 0


class ScriptedSuite:
    """A suite whose drop per candidate is scripted by its key width (tune's selection under a score bound,
    apart from a model that can do the tasks: tests/eval/longctx/test_objective.py scores real ones)."""

    def __init__(self, drops):
        self.drops, self.scored = drops, []

    def score(self, spec, name):
        self.scored.append(name)
        d = self.drops[spec.k_bits]
        return {"score": 100.0 - d, "score_fp": 100.0, "score_drop": d, "score_drop_ci": [d, d], "within_noise": d == 0,
                "score_tasks": {"niah_single": 100.0 - d}, "n": 2, "seconds": 0.0}

    def describe(self):
        return {"length": 420, "tasks": ["niah_single"], "samples": 2, "protocol": "question-after", "score_fp": 100.0,
                "prefill_seconds": 0.0}


def test_a_score_drop_bound_rejects_the_cheaper_damaged_candidate(peaked_model, windows):
    suite = ScriptedSuite({2: 50.0, 4: 0.0})  # A (2-bit) loses 50 points, B (4-bit) none
    free = tune(peaked_model, windows[:1], [B, A], max_ppl_increase=1e6, suite=suite, **FAST)
    assert free["name"] == A.describe() and free["score_drop"] == 50.0  # no bound: the cheaper, reported on both
    assert free["suite"]["length"] == 420 and free["budget"]["max_score_drop"] is None
    suite.scored.clear()
    r = tune(peaked_model, windows[:1], [B, A], max_ppl_increase=1e6, suite=suite, max_score_drop=0, **FAST)
    assert r["name"] == B.describe() and r["score_drop"] == 0.0 and r["score"] == 100.0
    assert suite.scored == [A.describe(), B.describe()]  # each once, in order of bits
    assert [x.get("score_drop") for x in r["evaluated"]] == [50.0, 0.0]
    assert r["budget"]["max_score_drop"] == 0.0
    alone = tune(peaked_model, windows[:1], [B, A], suite=suite, max_score_drop=49.0, **FAST)  # the only budget
    assert alone["name"] == B.describe()
    assert tune(peaked_model, windows[:1], [B, A], suite=suite, max_score_drop=50.0, **FAST)["name"] == A.describe()


def test_a_bits_budget_with_a_score_bound_takes_the_cheapest_within_both(peaked_model, windows):
    suite = ScriptedSuite({2: 5.0, 4: 0.0})
    r = tune(peaked_model, windows[:1], [B, A], max_bits=20.0, suite=suite, max_score_drop=1.0, **FAST)
    assert r["name"] == B.describe() and suite.scored == [A.describe(), B.describe()]
    with pytest.raises(ValueError, match="dropped the long-context score too far"):
        tune(peaked_model, windows[:1], [B, A], max_bits=20.0, suite=ScriptedSuite({2: 5.0, 4: 5.0}),
             max_score_drop=1.0, **FAST)


def test_a_score_bound_needs_a_suite_and_a_valid_bound(peaked_model, windows):
    with pytest.raises(ValueError, match="max_score_drop needs suite"):
        tune(peaked_model, windows[:1], [A], max_score_drop=1.0, **FAST)
    with pytest.raises(ValueError, match="between 0 and 100"):
        tune(peaked_model, windows[:1], [A], suite=ScriptedSuite({2: 0.0}), max_score_drop=-1, **FAST)
