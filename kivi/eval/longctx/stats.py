"""Intervals of a suite's scores: a 95% percentile bootstrap of the mean, and of the paired difference
from full precision over the same samples (seeded, so a report is reproducible).

Scores are per-sample fractions in [0, 1] (RULER's partial credit), so a binomial interval (Wilson)
does not apply; the bootstrap resamples samples. A mean over several tasks resamples within each task
(stratified), so every resample keeps each task's weight.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def _strata_means(strata: Sequence[np.ndarray], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """``[resamples]`` means over strata of each stratum's resampled mean."""
    out = np.zeros(resamples)
    for x in strata:
        idx = rng.integers(0, len(x), size=(resamples, len(x)))
        out += x[idx].mean(axis=1)
    return out / len(strata)


def bootstrap_mean(strata: Sequence[Sequence[float]], *, seed: int = 0, resamples: int = RESAMPLES
                   ) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean over strata of each stratum's mean, and its 95% bootstrap interval.

    One stratum = one task's samples; pass one list for a single task."""
    xs = [np.asarray(s, dtype=float) for s in strata]
    if not xs or any(len(x) == 0 for x in xs):
        raise ValueError("every stratum needs at least one score")
    mean = float(np.mean([x.mean() for x in xs]))
    if all(len(x) == 1 for x in xs) and len(xs) == 1:
        return mean, mean, mean
    boots = _strata_means(xs, np.random.default_rng(seed), resamples)
    a = (1 - LEVEL) / 2
    return mean, float(np.quantile(boots, a)), float(np.quantile(boots, 1 - a))


def paired_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], *, seed: int = 0,
                      resamples: int = RESAMPLES) -> tuple[float, float, float]:
    """``(diff, low, high)`` of ``mean(a) - mean(b)`` where ``a[s][i]`` and ``b[s][i]`` are the same
    sample: the bootstrap resamples sample indices and takes both scores of each (paired)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError("paired scores need the same samples on both sides")
    return bootstrap_mean([np.asarray(x, float) - np.asarray(y, float) for x, y in zip(a, b)], seed=seed,
                          resamples=resamples)


def within_noise(low: float, high: float) -> bool:
    """Whether a difference's interval contains 0."""
    return low <= 0.0 <= high


__all__ = ["LEVEL", "RESAMPLES", "bootstrap_mean", "paired_difference", "within_noise"]
