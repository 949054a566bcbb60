"""Budgeted config selection (`kivi tune`): :func:`select_config` over measured rows, :func:`tune` (profile,
candidates, measurement on the streaming protocol)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..config import KiviConfig
from .caches import synthetic_bits
from .candidates import (
    HEAD_STEPS,
    PLANNER_TOKENS,
    candidate_grid,
    candidate_name,
    has_tiers,
    profiled_head_candidates,
    tiers_comparable,
)
from .progress import progress_bar


def parse_percent(value: str | float) -> float:
    """``"5%"`` or ``"5"`` -> 5.0 (percent)."""
    s = str(value).strip()
    try:
        v = float(s[:-1] if s.endswith("%") else s)
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a percentage (e.g. 5%)") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"a perplexity increase budget must be >= 0, got {value!r}")
    return v


def fits(row: dict[str, Any], *, max_ppl_increase: float | None = None, max_bits: float | None = None,
         max_score_drop: float | None = None) -> bool:
    """Whether a measured row is within every given budget: Δppl % (``delta_ppl_pct``), bits per element
    (``bits_per_element``) and the long-context suite's score drop from full precision in points
    (``score_drop``, :meth:`kivi.eval.longctx.objective.SuiteReference.score`); a row without a number a
    budget needs does not fit. The one admissibility rule of :func:`select_config` and :func:`tune`."""
    def within(key: str, bound: float | None) -> bool:
        v = row.get(key)
        return bound is None or (v is not None and math.isfinite(v) and v <= bound)

    return (within("delta_ppl_pct", max_ppl_increase) and within("bits_per_element", max_bits)
            and within("score_drop", max_score_drop))


def select_config(
    rows: Sequence[dict[str, Any]],
    *,
    max_ppl_increase: float | None = None,
    max_bits: float | None = None,
    max_score_drop: float | None = None,
    score: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Pick a row under a budget.

    * ``max_ppl_increase`` (percent) and/or ``max_score_drop`` (points of the long-context suite): the row
      with the fewest bits per element within them (ties: lower perplexity);
    * ``max_bits`` alone: the row with the lowest perplexity within that many bits per element (ties:
      fewer bits);
    * ``max_bits`` with another budget: the cheapest row satisfying all.

    Rows need ``bits_per_element`` and ``delta_ppl_pct`` (and ``ppl``); rows with ``unavailable``
    or missing numbers are ignored. With ``max_score_drop``, a row needs ``score_drop``: ``score`` (when
    given) is called on a row without one, in the order of preference, to add it (the suite is scored only
    as far as the pick needs). Admissibility is :func:`fits`. Raises ``ValueError`` when nothing fits,
    naming the closest.
    """
    if max_ppl_increase is None and max_bits is None and max_score_drop is None:
        raise ValueError("give a budget: max_ppl_increase (percent), max_bits (bits per element) and/or "
                         "max_score_drop (points)")
    ok_rows = [r for r in rows if not r.get("unavailable") and r.get("bits_per_element") is not None
               and r.get("delta_ppl_pct") is not None and math.isfinite(r["bits_per_element"])]
    if not ok_rows:
        raise ValueError("no measured candidates to choose from")
    if max_ppl_increase is None and max_score_drop is None:
        order = sorted(ok_rows, key=lambda r: (r["delta_ppl_pct"], r["bits_per_element"]))
    else:
        order = sorted(ok_rows, key=lambda r: (r["bits_per_element"], r["delta_ppl_pct"]))
    budget = {"max_ppl_increase": max_ppl_increase, "max_bits": max_bits}
    suite_rejected = []
    for r in order:
        if not fits(r, **budget):
            continue
        if max_score_drop is not None and r.get("score_drop") is None and score is not None:
            score(r)
        if fits(r, **budget, max_score_drop=max_score_drop):
            return r
        if r.get("score_drop") is not None:
            suite_rejected.append(r)
    best_q = min(ok_rows, key=lambda r: r["delta_ppl_pct"])
    cheapest = min(ok_rows, key=lambda r: r["bits_per_element"])
    msg = ("no candidate fits the budget"
           + (f" max_ppl_increase={max_ppl_increase}%" if max_ppl_increase is not None else "")
           + (f" max_bits={max_bits}" if max_bits is not None else "")
           + (f" max_score_drop={max_score_drop} points" if max_score_drop is not None else "")
           + f"; best quality: {best_q['name']} "
           f"({best_q['delta_ppl_pct']:+.2f}% at {best_q['bits_per_element']:.2f} bits),"
           f" cheapest: {cheapest['name']} "
           f"({cheapest['bits_per_element']:.2f} bits, {cheapest['delta_ppl_pct']:+.2f}%)")
    if suite_rejected:
        least = min(suite_rejected, key=lambda r: r["score_drop"])
        msg += (f"; {len(suite_rejected)} within the other budgets dropped the long-context score too far "
                f"(least: {least['name']}, {least['score_drop']:.2f} points)")
    raise ValueError(msg)


#: the fields :meth:`kivi.eval.longctx.objective.SuiteReference.score` adds to a scored row (and tune's result)
SUITE_FIELDS = ("score", "score_fp", "score_drop", "score_drop_ci", "within_noise", "score_tasks")


class NoCandidateFits(ValueError):
    """:func:`tune` measured its candidates and none fits the budget; ``result`` holds what it measured (the
    keys of tune's result except the chosen config's)."""

    def __init__(self, message: str, result: dict[str, Any]):
        super().__init__(message)
        self.result = result


def tune(
    model: Any,
    windows: torch.Tensor,
    candidates: Sequence[KiviConfig] | None = None,
    *,
    max_ppl_increase: float | None = None,
    max_bits: float | None = None,
    profile: dict[str, Any] | None = None,
    prefix: int = 512,
    chunk: int = 16,
    batch_size: int = 1,
    progress: bool = True,
    fast: bool = True,
    early_stop: float | None = 2.0,
    bits_at: int | None = PLANNER_TOKENS,
    profile_windows: torch.Tensor | None = None,
    head_steps: Sequence[float] = HEAD_STEPS,
    head_bases: Sequence[KiviConfig] | None = None,
    suite: Any = None,
    max_score_drop: float | None = None,
) -> dict[str, Any]:
    """Cheapest candidate within a Δppl budget (or best within a bits budget), measured.

    **Bits.** ``bits_at`` (default 32768): candidates are ranked and budgeted by bits per
    element as the planner counts them, its cache bytes for a float16 model at ``bits_at`` tokens
    (:func:`kivi.eval.head_profile.bits_per_element`, byte-exact against ``cache.nbytes``); ``None``: by
    the bits the real cache holds at the end of an evaluation window (a synthetic fill in the model's
    dtype, where the 128-token FP window weighs a lot at 1K tokens). Every row reports both:
    ``bits_per_element`` (the ranking basis, ``bits_basis``), ``bits_at_eval`` (``cache.nbytes`` of the
    measured cache at the window's end) and ``bits_planner`` (planner, float16, ``bits_at`` or 32768 tokens).

    **Search space** (``candidates`` ``None``): :func:`~kivi.eval.candidates.candidate_grid` (uniform widths x
    group sizes x 0/4 sinks, per-layer upgrades of a layer ``profile``), position tiers only when
    :func:`~kivi.eval.candidates.tiers_comparable` (bits counted at no more than the windows' length: a
    tiered cache's mix of widths depends on the length), and, given ``profile_windows`` (token windows
    disjoint from ``windows``), per-head mixes of ``head_bases`` at their bits + ``head_steps`` and at
    ``max_bits`` (:func:`~kivi.eval.candidates.profiled_head_candidates`), added to given ``candidates`` too.
    A candidate that does not fit the model, or a tiered one whose bits would be counted at a longer
    length than it is measured at, is listed in ``skipped`` with the reason.

    Perplexities are measured in order of increasing bits, stopping at the first candidate within
    ``max_ppl_increase`` (with only ``max_bits``, every candidate under it is measured). The FP pass runs
    first, once: per window the full-precision prefill (kept, and replayed into every candidate's cache,
    :class:`~kivi.eval.stream.Prefill`) and the FP perplexity. ``fast``: :func:`~kivi.eval.stream.compare`'s
    fast mode (packed attention, one forward per continuation). ``early_stop`` (with ``max_ppl_increase``):
    a candidate is dropped after a window when its Δppl over the windows measured so far exceeds
    ``early_stop`` x the budget; it is listed with ``"stopped_early"`` and never chosen (``None`` or 0:
    measure every window).

    **Long-context suite.** ``suite`` (a :class:`~kivi.eval.longctx.objective.SuiteReference`: its
    full-precision prefills, built once, are replayed into every candidate it scores) adds each scored
    candidate's suite score and ``score_drop`` (points, FP minus the candidate on the same samples, with
    its paired interval); ``max_score_drop`` (needs ``suite``) makes a candidate admissible only if its drop
    is at most that many points, and the pick is the cheapest within every budget: a candidate within the
    other budgets is scored as it is measured, in order of bits, and the first one within the drop is the
    pick (``max_score_drop`` alone is a budget too). With a ``suite``, the pick is always scored: the
    result reports it on perplexity and on the suite (``score``, ``score_fp``, ``score_drop``,
    ``score_drop_ci``, ``within_noise``, ``score_tasks``; ``suite``: the suite's protocol and FP side).

    Returns ``{"config": {...}, "name", "ppl", "ppl_fp", "delta_ppl_pct", "bits_per_element", "bits_basis",
    "bits_at_eval", "bits_planner", "seconds": {"profile", "fp", "candidates"}, "search", "evaluated": [rows],
    "skipped"}``. Raises :class:`NoCandidateFits` (a ``ValueError`` carrying the measured rows) when none fits.
    """
    import time  # noqa: PLC0415

    from ..memory.sources import model_spec  # noqa: PLC0415
    from .head_profile import bits_per_element as planner_bits  # noqa: PLC0415
    from .metrics import Accumulator  # noqa: PLC0415
    from .protocol import check_windows, measure_window, run_prefill  # noqa: PLC0415

    if max_score_drop is not None:
        from .longctx.objective import check_score_drop  # noqa: PLC0415

        max_score_drop = check_score_drop(max_score_drop)
        if suite is None:
            raise ValueError("max_score_drop needs suite (a kivi.eval.longctx.objective.SuiteReference)")
    if max_ppl_increase is None and max_bits is None and max_score_drop is None:
        raise ValueError("give a budget: max_ppl_increase (percent), max_bits (bits per element) and/or "
                         "max_score_drop (points of the long-context suite)")
    if early_stop is not None and (isinstance(early_stop, bool) or not isinstance(early_stop, (int, float))
                                   or not math.isfinite(early_stop) or early_stop < 0 or 0 < early_stop < 1):
        raise ValueError(f"early_stop={early_stop!r} must be None, 0 (off) or a factor >= 1 of the budget")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if bits_at is not None and (isinstance(bits_at, bool) or not isinstance(bits_at, int) or bits_at < 1):
        raise ValueError(f"bits_at={bits_at!r} must be None (bits held at the evaluation context) or a positive "
                         "number of tokens")
    windows = check_windows(windows, prefix, chunk)
    ctx = windows.shape[-1]
    if profile_windows is not None:
        profile_windows = check_windows(profile_windows, prefix, chunk)
    tiers_ok = tiers_comparable(bits_at, ctx)
    cands = list(candidates) if candidates is not None else candidate_grid(profile, tiers=tiers_ok)
    if not cands and profile_windows is None:
        raise ValueError("no candidate configs")
    planner_tokens = bits_at if bits_at is not None else PLANNER_TOKENS
    spec = model_spec(model, dtype="float16")
    seconds = {"profile": 0.0, "fp": 0.0, "candidates": 0.0}
    skipped: list[dict[str, str]] = []
    per_head: list[KiviConfig] = []
    if profile_windows is not None:
        t0 = time.time()
        per_head, why = profiled_head_candidates(model, profile_windows, spec, bases=head_bases, steps=head_steps,
                                                 budgets=[max_bits] if max_bits is not None else [],
                                                 context=planner_tokens, prefix=prefix, progress=progress)
        skipped += why
        seconds["profile"] = round(time.time() - t0, 1)
        cands += per_head
    est = []
    for i, c in enumerate(cands):
        if has_tiers(c) and not tiers_ok:
            skipped.append({"name": candidate_name(c), "reason": (
                f"position tiers: measured on {ctx}-token windows but bits counted at {bits_at} tokens, where its "
                "tokens sit in other tiers; count bits at the evaluation context (bits_at=None, --bits-at eval)")})
            continue
        try:  # a candidate that does not fit this model (e.g. group_size vs head_dim) is skipped
            plan = planner_bits(spec, c, planner_tokens)
            rank = plan if bits_at is not None else synthetic_bits(model, c, ctx, prefix=prefix, chunk=chunk)
        except ValueError as e:
            skipped.append({"name": candidate_name(c), "reason": str(e)})
            continue
        est.append((rank, i, c, plan))
    if not est:
        raise ValueError(f"no candidate config fits this model: {skipped[0]['reason'] if skipped else ''}")
    est.sort(key=lambda t: (t[0], t[1]))
    if max_bits is not None:
        est = [t for t in est if t[0] <= max_bits]
        if not est:
            raise ValueError(f"no candidate fits max_bits={max_bits} bits/element")
    batches = [windows[w : w + batch_size] for w in range(0, windows.shape[0], batch_size)]
    per_window = len(batches)
    scored = windows.shape[0] * (ctx - prefix)
    bar = progress_bar(scored * (1 + len(est)), "tune", progress, unit="tok")
    fp = Accumulator(None)
    fp_nll: list[tuple[float, int]] = []  # per batch: (nll sum, tokens), for the partial Δppl of early stopping
    prefills = []
    rows = []
    stop_at = early_stop * max_ppl_increase if early_stop and max_ppl_increase is not None else None
    budget = {"max_ppl_increase": max_ppl_increase, "max_bits": max_bits, "max_score_drop": max_score_drop}
    sequential = max_ppl_increase is not None or max_score_drop is not None  # the cheapest within: stop at the first
    cfgs: dict[int, KiviConfig] = {}

    def score(r: dict[str, Any]) -> None:
        t = time.time()
        r.update(suite.score(cfgs[id(r)], r["name"]))
        seconds["suite"] = round(seconds.get("suite", 0.0) + time.time() - t, 1)
    try:
        t0 = time.time()
        for j, ids in enumerate(batches):
            pre = run_prefill(model, ids, prefix) if fast else None
            before = (fp.nll, fp.tokens)
            measure_window(model, ids, fp, prefix=prefix, chunk=chunk, prefill=pre, fast=fast, bar=bar,
                           where=f"FP reference, window {j + 1}/{per_window}")
            fp_nll.append((fp.nll - before[0], fp.tokens - before[1]))
            prefills.append(pre)
        ppl_fp = math.exp(fp.nll / fp.tokens)
        seconds["fp"] = round(time.time() - t0, 1)
        t0 = time.time()
        for k, (rank, _, c, plan) in enumerate(est):
            acc = Accumulator(c)
            stopped = None
            for j, ids in enumerate(batches):
                measure_window(model, ids, acc, prefix=prefix, chunk=chunk, prefill=prefills[j], fast=fast, bar=bar,
                               where=f"candidate {k + 1}/{len(est)}, window {j + 1}/{per_window}")
                ref_nll = sum(x[0] for x in fp_nll[: j + 1]) / sum(x[1] for x in fp_nll[: j + 1])
                partial = 100.0 * (math.exp(acc.nll / acc.tokens - ref_nll) - 1.0)
                if stop_at is not None and j + 1 < per_window and partial > stop_at:
                    stopped = partial
                    bar.update((per_window - j - 1) * batches[0].shape[0] * (ctx - prefix))
                    break
            r = acc.result()
            done = fp_nll[: j + 1]  # the FP perplexity of the windows this candidate ran on
            r["delta_ppl_pct"] = 100.0 * (r["ppl"] / math.exp(sum(x[0] for x in done) / sum(x[1] for x in done)) - 1.0)
            r["name"] = candidate_name(c)
            r["bits_at_eval"] = r["bits_per_element"]
            r["bits_planner"] = plan
            r["bits_per_element"] = rank if bits_at is not None else r["bits_at_eval"]
            r["bits_estimated"] = rank
            cfgs[id(r)] = c
            if stopped is not None:
                r["stopped_early"] = (f"Δppl {stopped:+.2f}% after {r['windows']} of {windows.shape[0]} windows "
                                      f"> {early_stop:g} x the {max_ppl_increase:g}% budget")
            rows.append(r)
            bar.set_postfix_str(f"{r['name']}: {r['bits_per_element']:.2f} bits, {r['delta_ppl_pct']:+.2f}%"
                                + (" (stopped early)" if stopped is not None else ""))
            if stopped is None and sequential and fits(r, max_ppl_increase=max_ppl_increase, max_bits=max_bits):
                if max_score_drop is not None:
                    score(r)
                if fits(r, **budget):
                    break
        seconds["candidates"] = round(time.time() - t0, 1)
    finally:
        bar.close()
    basis = (f"planner, float16 model, {bits_at} tokens" if bits_at is not None
             else f"cache.nbytes at the end of a {ctx}-token evaluation window (model dtype)")
    report = {"ppl_fp": ppl_fp, "bits_basis": basis, "bits_planner_tokens": planner_tokens,
              "budget": {"max_ppl_increase_pct": max_ppl_increase, "max_bits": max_bits,
                         "max_score_drop": max_score_drop},
              "protocol": {"windows": int(windows.shape[0]), "context": int(ctx), "prefix": prefix, "chunk": chunk,
                           "fast": fast, "early_stop": early_stop, "bits_at": bits_at,
                           "profile_windows": int(profile_windows.shape[0]) if profile_windows is not None else 0},
              "search": {"candidates": len(cands), "ranked": len(est), "per_head": len(per_head),
                         "tiers": "searched" if tiers_ok else
                         f"not searched: bits counted at {bits_at} tokens, longer than the {ctx}-token windows"},
              "seconds": seconds, "evaluated": rows, "skipped": skipped}
    if suite is not None:
        report["suite"] = suite.describe()
    complete = [r for r in rows if "stopped_early" not in r]
    if not complete:
        best_partial = min(rows, key=lambda r: r["delta_ppl_pct"])
        raise NoCandidateFits(
            f"no candidate fits the budget max_ppl_increase={max_ppl_increase}%: every one was over {early_stop:g} x "
            f"the budget (best: {best_partial['name']}, {best_partial['stopped_early']})", report)
    try:
        best = select_config(complete, **budget, score=score if suite is not None else None)
    except ValueError as e:
        raise NoCandidateFits(str(e), report) from None
    if suite is not None and "score_drop" not in best:
        score(best)  # the pick is reported on the suite too
    cfg = cfgs[id(best)]
    on_suite = {k: best[k] for k in SUITE_FIELDS} if suite is not None else {}
    return {"config": cfg.to_dict(), "name": best["name"], "ppl": best["ppl"], "delta_ppl_pct": best["delta_ppl_pct"],
            "bits_per_element": best["bits_per_element"], "bits_at_eval": best["bits_at_eval"],
            "bits_planner": best["bits_planner"], "cache_bytes": best["cache_bytes"], **on_suite, **report}




__all__ = ["SUITE_FIELDS", "NoCandidateFits", "fits", "parse_percent", "select_config", "tune"]
