"""The summary of a run's rows: one row per (config, length, task, protocol), with the score (in points,
0-100), its 95% interval, the bits per element, and the paired difference from full precision.

Two averages per (config, length, protocol) are added as tasks: ``average`` (every task) and
``average_fp_meaningful`` (the tasks on which full precision scores above :data:`MEANINGFUL` points at
that length; a task the model cannot do at full precision says nothing about a cache). Their intervals
resample within each task (stratified bootstrap). With one sample of a task there is nothing to resample:
the intervals (and ``within_noise``) are ``None``. Failed answers (no score) are left out; :func:`failures`
counts them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from .stats import LEVEL, RESAMPLES, bootstrap_mean, paired_difference, within_noise

MEANINGFUL = 20.0  # points: full precision above this on a task at a length
INTERVAL = f"{int(LEVEL * 100)}% percentile bootstrap over samples ({RESAMPLES} resamples, seeded)"


def summarize(rows: Sequence[dict[str, Any]], *, configs: Sequence[str] | None = None, fp: str = "fp",
              seed: int = 0) -> list[dict[str, Any]]:
    """Summary rows (see the module doc), ordered by protocol, length, config (``configs`` order), task."""
    by: dict[tuple, dict[int, float]] = defaultdict(dict)
    bits: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("score") is None:  # a failed answer (runner.failed_answer): counted by failures()
            continue
        k = (r["config"], r["length"], r["task"], r["protocol"])
        by[k][r["sample"]] = r["score"]
        bits[k].append(r["bits_per_element"])
    names = list(configs) if configs else list(dict.fromkeys(r["config"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    groups = sorted({(k[3], k[1]) for k in by}, key=lambda x: (x[0], x[1]))
    out: list[dict[str, Any]] = []
    for proto, L in groups:
        fp_means = {t: 100 * sum(v.values()) / len(v) for t in tasks if (v := by.get((fp, L, t, proto)))}
        good = [t for t in tasks if fp_means.get(t, 0.0) > MEANINGFUL]
        for c in names:
            have = [t for t in tasks if (c, L, t, proto) in by]
            for t in have:
                out.append(_row(by, bits, c, L, proto, t, [t], fp, seed))
            for name, ts in (("average", have), ("average_fp_meaningful", [t for t in good if t in have])):
                if len(ts) > 0 and len(have) > 1:
                    out.append(_row(by, bits, c, L, proto, name, ts, fp, seed))
            for r in out:
                if r["config"] == c and r["length"] == L and r["protocol"] == proto and r["task"] in fp_means:
                    r["fp_meaningful"] = fp_means[r["task"]] > MEANINGFUL
    return out


def failures(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config with failed answers (``score`` None, :func:`.runner.failed_answer`): ``failed`` of ``answers``
    and the first ``error``."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        f = out.setdefault(r["config"], {"failed": 0, "answers": 0, "error": None})
        f["answers"] += 1
        if r.get("score") is None:
            f["failed"] += 1
            f["error"] = f["error"] or r.get("error")
    return {c: f for c, f in out.items() if f["failed"]}


def _row(by, bits, c, L, proto, name, ts, fp, seed) -> dict[str, Any]:
    idx = [sorted(by[(c, L, t, proto)]) for t in ts]
    strata = [[by[(c, L, t, proto)][i] for i in ix] for t, ix in zip(ts, idx)]
    mean, lo, hi = bootstrap_mean(strata, seed=seed)
    b = [x for t in ts for x in bits[(c, L, t, proto)]]
    row: dict[str, Any] = {"config": c, "length": L, "task": name, "protocol": proto, "score": 100 * mean,
                           "n": sum(len(s) for s in strata), "ci_low": 100 * lo, "ci_high": 100 * hi,
                           "bits_per_element": sum(b) / len(b), "diff_vs_fp": None, "diff_ci_low": None,
                           "diff_ci_high": None, "within_noise": None}
    if name.startswith("average"):
        row["tasks"] = list(ts)
    if min(len(x) for x in strata) < 2:  # one sample per task: a bootstrap has nothing to resample
        row.update(ci_low=None, ci_high=None)
    if all((fp, L, t, proto) in by for t in ts):
        pairs = [[i for i in ix if i in by[(fp, L, t, proto)]] for t, ix in zip(ts, idx)]
        if all(pairs):
            a = [[by[(c, L, t, proto)][i] for i in p] for t, p in zip(ts, pairs)]
            f = [[by[(fp, L, t, proto)][i] for i in p] for t, p in zip(ts, pairs)]
            d, dlo, dhi = paired_difference(a, f, seed=seed)
            row.update(diff_vs_fp=100 * d, diff_ci_low=100 * dlo, diff_ci_high=100 * dhi,
                       within_noise=within_noise(dlo, dhi))
            if min(len(x) for x in a) < 2:
                row.update(diff_ci_low=None, diff_ci_high=None, within_noise=None)
    return row


__all__ = ["INTERVAL", "MEANINGFUL", "failures", "summarize"]
