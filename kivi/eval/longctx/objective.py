"""The long-context suite as a tuning objective: a candidate config's suite score and its paired drop from
full precision, every candidate replaying the same full-precision prefills.

:class:`SuiteReference` builds the suite's samples once (one length, the chosen tasks, ``samples`` each, a
seed), prefills each once at full precision (:func:`.runner.record_prefill`) and answers it at full
precision; the states are kept in memory (:attr:`SuiteReference.prefill_bytes`), so scoring a candidate
(:meth:`SuiteReference.score`) costs one replay, the question and a short answer per sample
(:func:`.runner.answer`), never a prefill. The score is the suite's average over the tasks (each task's
mean, in points 0-100) and the drop is full precision's minus the candidate's on the same samples, with
the paired 95% interval of :func:`.summary.summarize` (the one summary the suite's report uses).
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from ..progress import progress_bar
from . import runner
from .haystack import Haystack, Template
from .protocols import PROTOCOLS, check_protocols
from .summary import summarize
from .tasks import MAX_NEW_TOKENS, check_tasks, make_sample

FP = "fp"
#: what `kivi tune --score-length` scores when no tasks are named: a retrieval, a multi-hop and a QA task
DEFAULT_TASKS = ("niah_single", "niah_multikey", "vt", "qa")
DEFAULT_SAMPLES = 5


def check_score_drop(value: Any) -> float:
    """A score-drop bound: a finite number of points in ``[0, 100]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= 100:
        raise ValueError(f"max_score_drop={value!r} must be a number of points between 0 and 100")
    return float(value)


class SuiteReference:
    """The full-precision side of the suite at one ``length``: samples, prefills and FP answers, built once.

    ``protocol``: ``question-after`` (default; the question reads the candidate's cache) or ``one-shot``
    (:mod:`.runner`). Raises ``ValueError`` for unknown tasks or protocol, ``samples < 1``, or a
    ``length`` plus the longest answer past ``max_context`` (when given)."""

    def __init__(self, model: Any, tok: Any, text: str, *, length: int, tasks: Sequence[str], samples: int,
                 seed: int = 0, protocol: str = PROTOCOLS[0], max_context: int | None = None,
                 progress: bool = False):
        tasks = check_tasks(list(tasks))
        protocol = check_protocols([protocol])[0]
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples={samples!r} must be a positive integer")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length={length!r} must be a positive number of tokens")
        longest = max(MAX_NEW_TOKENS[t] for t in tasks)
        if max_context is not None and length + longest > max_context:
            raise ValueError(f"length {length} + a {longest}-token answer needs {length + longest} tokens, longer "
                             f"than the model supports ({max_context} tokens)")
        self.model, self.tok = model, tok
        self.length, self.tasks, self.samples, self.seed, self.protocol = length, tasks, samples, seed, protocol
        hay, tpl = Haystack.from_text(tok, text), Template.of(tok)
        t0, c0 = time.perf_counter(), time.process_time()
        self.items = []
        bar = progress_bar(len(tasks) * samples, f"suite FP prefills at {length} tokens", enabled=progress,
                           unit="prefill")
        try:
            for t in tasks:
                for i in range(samples):
                    s = make_sample(hay, tpl, t, length, i, samples=samples, seed=seed)
                    self.items.append((s, runner.record_prefill(model, s.context if protocol == "question-after"
                                                                 else s.ids)))
                    bar.update(1)
        finally:
            bar.close()
        self.prefill_seconds = time.perf_counter() - t0
        self.prefill_cpu_seconds = time.process_time() - c0
        self.prefill_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                 for _, (states, _) in self.items for k, v in states)
        self.fp_rows = self._rows(FP, None)
        self.fp = self._summary([])[0]

    def _rows(self, name: str, spec: Any) -> list[dict[str, Any]]:
        rows = []
        for s, pre in self.items:
            r = runner.answer(self.model, self.tok, spec, s, self.protocol, pre)
            rows.append({"config": name, "length": self.length, "task": s.task, "protocol": self.protocol,
                         "sample": s.index, "score": r["score"], "bits_per_element": r["bits_per_element"],
                         "answer": r["answer"], "decode_seconds": r["decode_seconds"]})
        return rows

    def _summary(self, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The average row of ``FP`` (``rows`` empty) or of ``rows``' config, and its per-task rows."""
        name = rows[0]["config"] if rows else FP
        out = [r for r in summarize(self.fp_rows + rows, configs=[FP, name], seed=self.seed) if r["config"] == name]
        per_task = {r["task"]: r for r in out if r["task"] in self.tasks}
        avg = next((r for r in out if r["task"] == "average"), None) or per_task[self.tasks[0]]
        return avg, per_task

    def score(self, spec: Any, name: str = "candidate") -> dict[str, Any]:
        """``spec``'s suite result: ``score`` (points, average over the tasks), ``score_fp``, ``score_drop``
        (FP minus ``spec``, same samples), ``score_drop_ci`` (its paired 95% interval, ``None`` with one
        sample per task), ``within_noise``, ``score_tasks`` ({task: points}), ``n``, ``seconds``."""
        if name == FP:
            raise ValueError(f"name={name!r} is the full-precision reference's label; give the candidate another")
        t0 = time.perf_counter()
        avg, per_task = self._summary(self._rows(name, spec))
        lo, hi = avg["diff_ci_low"], avg["diff_ci_high"]
        return {"score": avg["score"], "score_fp": self.fp["score"], "score_drop": 0.0 - avg["diff_vs_fp"],
                "score_drop_ci": None if lo is None else [0.0 - hi, 0.0 - lo], "within_noise": avg["within_noise"],
                "score_tasks": {t: r["score"] for t, r in per_task.items()}, "n": avg["n"],
                "seconds": round(time.perf_counter() - t0, 2)}

    def describe(self) -> dict[str, Any]:
        """The suite's protocol and full-precision side, for a report."""
        _, per_task = self._summary([])
        return {"length": self.length, "tasks": list(self.tasks), "samples": self.samples, "seed": self.seed,
                "protocol": self.protocol, "score_fp": self.fp["score"],
                "score_fp_tasks": {t: r["score"] for t, r in per_task.items()},
                "prefills": len(self.items), "prefill_seconds": round(self.prefill_seconds, 2),
                "prefill_cpu_seconds": round(self.prefill_cpu_seconds, 2), "prefill_bytes": self.prefill_bytes,
                "score_unit": "points (0-100): mean over samples of RULER's fraction of expected strings found, "
                              "averaged over the tasks"}


__all__ = ["DEFAULT_SAMPLES", "DEFAULT_TASKS", "FP", "SuiteReference", "check_score_drop"]
