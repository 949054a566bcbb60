"""RULER's scoring and the suite's statistics against cases whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from kivi.eval.longctx.scoring import string_match_all
from kivi.eval.longctx.stats import bootstrap_mean, paired_difference, within_noise
from kivi.eval.longctx.summary import summarize


def test_string_match_all():
    assert string_match_all(" 123 and 456", ["123", "456"]) == 1.0
    assert string_match_all("The answer: APPLE", ["apple", "pear", "plum", "fig"]) == 0.25
    assert string_match_all("", ["x"]) == 0.0
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_bootstrap_of_a_constant_and_of_a_coin():
    assert bootstrap_mean([[0.5] * 7]) == (0.5, 0.5, 0.5)
    coin = [1.0, 0.0] * 50  # mean 0.5, n 100: normal interval 0.5 +- 1.96 * 0.05
    m, lo, hi = bootstrap_mean([coin], seed=3)
    assert m == 0.5 and abs(lo - 0.402) < 0.02 and abs(hi - 0.598) < 0.02
    assert bootstrap_mean([coin], seed=3) == (m, lo, hi)  # seeded


def test_stratified_mean_weights_tasks_equally():
    m, lo, hi = bootstrap_mean([[1.0] * 10, [0.0] * 2])
    assert m == 0.5 and lo == hi == 0.5  # each stratum constant: every resample gives 0.5


def test_paired_difference_sees_what_unpaired_noise_hides():
    rng = np.random.default_rng(0)
    base = rng.random(40)
    a, b = base + 0.02, base  # every sample 0.02 better: unpaired intervals overlap, the paired one excludes 0
    d, lo, hi = paired_difference([a], [b])
    assert abs(d - 0.02) < 1e-12 and abs(lo - 0.02) < 1e-9 and abs(hi - 0.02) < 1e-9 and not within_noise(lo, hi)
    _, alo, ahi = bootstrap_mean([a])
    assert alo < b.mean() < ahi
    d, lo, hi = paired_difference([[1, 0, 1, 0]], [[0, 1, 0, 1]])
    assert d == 0 and within_noise(lo, hi) and lo < 0 < hi
    with pytest.raises(ValueError, match="same samples"):
        paired_difference([[1, 0]], [[1]])


def _rows(config, task, scores, bits=2.0):
    return [{"config": config, "length": 100, "task": task, "protocol": "question-after", "sample": i, "score": s,
             "bits_per_element": bits} for i, s in enumerate(scores)]


def test_summary_rows():
    rows = (_rows("fp", "a", [1, 1, 1, 1], 32) + _rows("fp", "b", [0, 0, 0, 0.1], 32)
            + _rows("q", "a", [1, 0, 1, 1]) + _rows("q", "b", [0, 0, 0, 0.1]))
    s = {(r["config"], r["task"]): r for r in summarize(rows, configs=["fp", "q"])}
    assert s[("q", "a")]["score"] == 75.0 and s[("q", "a")]["n"] == 4 and s[("q", "a")]["diff_vs_fp"] == -25.0
    assert s[("q", "a")]["within_noise"] is True  # one sample of four
    assert s[("q", "b")]["diff_vs_fp"] == 0.0 and s[("q", "b")]["fp_meaningful"] is False
    assert s[("q", "average")]["score"] == pytest.approx((75 + 2.5) / 2) and s[("q", "average")]["n"] == 8
    assert s[("q", "average_fp_meaningful")]["tasks"] == ["a"]
    assert s[("fp", "average")]["bits_per_element"] == 32 and s[("fp", "a")]["diff_vs_fp"] == 0.0


def test_one_sample_has_no_interval():
    s = {r["config"]: r for r in summarize(_rows("fp", "a", [1]) + _rows("q", "a", [0]))}
    assert s["q"]["diff_vs_fp"] == -100.0 and s["q"]["ci_low"] is None and s["q"]["within_noise"] is None
