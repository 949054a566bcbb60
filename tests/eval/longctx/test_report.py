"""kivi.eval.longctx.report: the plot's averages compare the same tasks for every config."""

from __future__ import annotations

from kivi.eval.longctx.report import _common_averages


def test_averages_over_the_tasks_every_config_ran():
    rows = [{"config": c, "length": 100, "protocol": "one-shot", "task": t, "score": s, "bits_per_element": b}
            for c, t, s, b in (("fp", "a", 50.0, 32.0), ("fp", "b", 100.0, 32.0), ("q", "a", 40.0, 3.0),
                               ("q", "average", 40.0, 3.0))]
    got = {r["config"]: (r["score"], r["bits_per_element"]) for r in _common_averages(rows)}
    assert got == {"fp": (50.0, 32.0), "q": (40.0, 3.0)}  # task b: only fp ran it
