#!/usr/bin/env python
"""The Pareto table of several evaluation results: bits per element at 32K tokens (the planner's count for a
float16 model) against perplexity, KL and top-1 agreement, with a CSV and a plot.

The measurements themselves are ``kivi sweep`` runs on the 20-window protocol (docs/evaluation.md has the
commands), e.g.

    OMP_NUM_THREADS=1 kivi sweep --grid none --presets extreme,balanced,high --configs sink4.json heads.json \
        --no-baselines --windows 20 --batch-size 2 -o pareto.json
    python studies/pareto_table.py pareto.json results/quality/main_suite_20w.json \
        --extra-rows quanto-int4 quanto-int2-perchannel --csv pareto.csv --plot pareto.png --nbytes-tokens 32768

``--extra-rows`` takes only the named rows from the files after the first (e.g. quanto's rows of an earlier
file with the same windows: its 16-token chunks take hours here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kivi import KiviConfig
from kivi.models import load_model


def load_run(path: str) -> dict:
    """One result file as ``{"model", "protocol", "fp", "results"}``: a ``kivi sweep -o`` file (rows, FP first)
    or a file already in that shape."""
    d = json.loads(Path(path).read_text())
    if "rows" in d:
        rows = d["rows"]
        return {"model": d.get("model", "smollm2"), "protocol": rows[0]["protocol"], "fp": rows[0], "results": rows[1:]}
    return d


#: The precision targets drawn on the plot: (bits per element, Δppl %), <= +5 % at <= 3.3 bits and
#: <= +0.5 % at <= 4.3 bits.
GOALS = ((3.3, 5.0), (4.3, 0.5))


def bits_at_32k(model: str, cfg: KiviConfig) -> float:
    """Bits per element as ``kivi estimate`` counts them for a float16 model at 32K tokens: all bytes the
    cache holds (codes, scales, offsets, sinks, the window) over 2 x layers x kv heads x head_dim x tokens."""
    from kivi.eval.head_profile import bits_per_element

    return bits_per_element(model, cfg, 32768)  # ValueError: a config the model refuses


_MODELS: dict[str, object] = {}


def _nbytes_bits(model: str, spec, tokens: int | None) -> float | None:
    """The same bits per element from ``cache.nbytes`` of a real float16 cache after ``tokens`` tokens."""
    if not tokens or isinstance(spec, str):
        return None
    import dataclasses

    from kivi.eval.caches import synthetic_bits

    if model not in _MODELS:
        _MODELS[model] = load_model(model)[0]
    cfg = dataclasses.replace(spec, attention_backend="reference")
    try:
        return round(synthetic_bits(_MODELS[model], cfg, tokens, dtype=torch.float16), 4)
    except ValueError:  # a config the model refuses: the row says "unavailable" already
        return None


def parse_goal(text: str) -> tuple[float, float]:
    """``"3.3:5"`` -> (3.3 bits, 5.0 %)."""
    try:
        b, p = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--goal {text!r}: expected BITS:PCT, e.g. 3.3:5") from None
    return b, p


def summarize(paths: list[str], csv_path: str | None, plot: str | None,
              goals: tuple[tuple[float, float], ...] = GOALS, extra_rows: list[str] | None = None,
              nbytes_tokens: int | None = None) -> int:
    """Table (+ CSV / Pareto plot) of one or more result files measured with the same protocol and windows.

    A file is a ``kivi sweep -o`` result (``{"rows": [fp, ...]}``) or an older suite file (``{"protocol", "fp",
    "results"}``). Rows of later files with a name already seen are skipped, and with ``extra_rows`` only the
    rows of later files named there are taken (e.g. quanto's rows of an older 20-window file); ``bits_32k`` is
    :func:`bits_at_32k`, next to the harness's ``bits_per_element`` (real bytes of each 1K window); with
    ``nbytes_tokens``, ``bits_nbytes`` is the same definition read from ``cache.nbytes`` of a real KIVI cache
    after one float16 prefill of that many random tokens (kivi.eval.caches.synthetic_bits: no forward)."""
    from kivi.eval import spec_kind
    from kivi.eval.sweep import pareto_plot, write_rows

    runs = [load_run(p) for p in paths]
    d = runs[0]
    for other, p in zip(runs[1:], paths[1:]):
        # The same windows give the same FP perplexity up to float rounding: the fast evaluation's FP runs
        # 512-token forwards, the reference one 16-token chunks (19.651518 vs 19.651340 on the 20 windows).
        # Every row keeps the delta it measured against its own run's FP.
        rel = abs(other["fp"]["ppl"] / d["fp"]["ppl"] - 1.0)
        if other["protocol"]["windows"] != d["protocol"]["windows"] or rel > 1e-4:
            raise SystemExit(f"{p}: different windows or FP perplexity than {paths[0]}; not comparable")
        if rel > 1e-9:
            print(f"note: {p}: FP perplexity {other['fp']['ppl']:.6f} vs {d['fp']['ppl']:.6f} (rounding of another "
                  "evaluation path); its rows keep their own deltas")
    fp = dict(d["fp"], kind="fp", delta_ppl_pct=0.0, kl=0.0, top1_agreement=1.0, bits_32k=16.0)  # a float16 model
    rows = [fp]
    seen = set()
    for r in (r for k, run in enumerate(runs) for r in run["results"]
              if k == 0 or extra_rows is None or r["name"] in extra_rows):
        if r["name"] in seen:
            continue
        seen.add(r["name"])
        spec = r["config"] if isinstance(r["config"], str) else KiviConfig.from_dict(r["config"])
        try:
            b32 = None if isinstance(spec, str) else round(bits_at_32k(runs[0].get("model", "smollm2"), spec), 4)
        except ValueError:  # e.g. group_size=128 on head_dim 64: the row says "unavailable" already
            b32 = None
        rows.append(dict(r, kind=spec_kind(spec), bits_32k=b32,
                         bits_nbytes=_nbytes_bits(runs[0].get("model", "smollm2"), spec, nbytes_tokens)))
    if csv_path:
        write_rows(rows, csv_path)
    if plot:
        p = d["protocol"]
        pareto_plot(rows, plot, title=f"SmolLM2-135M-Instruct, WikiText-2: {p['windows']} windows x {p['context']} "
                                      f"tokens (prefix {p['prefix']}, chunk {p['chunk']})", goals=goals,
                    x_key="bits_32k", x_label="bits/element: kivi estimate, float16 model, 32K tokens "
                                              "(quanto: the harness's bytes)")
    print(f"{'name':28s} {'bits':>6s} {'b@32K':>6s} {'nbytes':>6s} {'bytes':>9s} {'ppl':>8s} {'dppl%':>7s} {'KL':>8s} "
          f"{'top1%':>6s}" + (f"   (nbytes: cache.nbytes after a float16 prefill of {nbytes_tokens} tokens)"
                              if nbytes_tokens else ""))
    for r in rows:
        if r.get("unavailable"):
            print(f"{r['name']:28s} unavailable: {r['unavailable']}")
            continue
        b32 = "" if r.get("bits_32k") is None else f"{r['bits_32k']:.3f}"
        bnb = "" if r.get("bits_nbytes") is None else f"{r['bits_nbytes']:.3f}"
        print(f"{r['name']:28s} {r['bits_per_element']:6.2f} {b32:>6s} {bnb:>6s} {r['cache_bytes']:9d} {r['ppl']:8.3f} "
              f"{r['delta_ppl_pct']:+7.2f} {r['kl']:8.4f} {100 * r['top1_agreement']:6.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="result JSON files measured on the same windows")
    ap.add_argument("--extra-rows", nargs="+", default=None, metavar="NAME",
                    help="take only these rows from the files after the first")
    ap.add_argument("--nbytes-tokens", type=int, default=None, metavar="TOKENS",
                    help="also bits per element from cache.nbytes after a float16 prefill of this many tokens")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--goal", type=parse_goal, action="append", default=None, metavar="BITS:PCT",
                    help="a target drawn on --plot (repeatable; default: 3.3:5 and 4.3:0.5)")
    a = ap.parse_args(argv)
    return summarize(a.files, a.csv, a.plot, tuple(a.goal) if a.goal else GOALS, a.extra_rows, a.nbytes_tokens)


if __name__ == "__main__":
    sys.exit(main())
