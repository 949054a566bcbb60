#!/usr/bin/env python
"""Measure KIVI configs and baselines on SmolLM2 / WikiText-2 with the streaming protocol.

Protocol (default): windows of 1024 tokens, prefix 512, chunk 16. Results are written to
``--out`` (JSON) after every batch of windows, so a partial run is still usable.

    python benchmarks/run_eval_suite.py --suite main --windows 20 --out results/main.json
    python benchmarks/run_eval_suite.py --suite sensitivity --windows 4 --out results/sensitivity.json
    python benchmarks/run_eval_suite.py --summarize a.json b.json --csv table.csv --plot pareto.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kivi import KiviConfig
from kivi.data import load_text, token_windows
from kivi.eval import compare
from kivi.models import load_model


def suites() -> dict[str, list]:
    P = KiviConfig.preset
    return {
        "key": [P("high"), P("extreme")],
        "main": [P("high"), P("balanced"), P("extreme"),
                 KiviConfig(group_size=64), KiviConfig(group_size=128),
                 KiviConfig(quantize_value=False), KiviConfig(quantize_key=False),
                 KiviConfig(symmetric=True),
                 "quanto-int4", "quanto-int2", "quanto-int2-perchannel"],
        # Sink tokens and the new presets (high / balanced use 4 sinks), the repaired compensation.
        "sinks": [P("high"), P("balanced"), KiviConfig(sink_tokens=1), KiviConfig(sink_tokens=4),
                  KiviConfig(k_bits=4, v_bits=2), KiviConfig(residual_bits=4)],
        "sensitivity": [KiviConfig(quantize_value=False), KiviConfig(quantize_key=False),
                        KiviConfig(symmetric=True), KiviConfig(group_size=64), KiviConfig(group_size=128),
                        KiviConfig(residual_length=32), KiviConfig(residual_length=0),
                        KiviConfig(residual_bits=2), KiviConfig(residual_bits=4),
                        KiviConfig(k_bits=4, v_bits=2), KiviConfig(k_bits=2, v_bits=4),
                        KiviConfig(k_bits=4, v_bits=4, residual_bits=4)],
    }


def summarize(paths: list[str], csv_path: str | None, plot: str | None) -> int:
    """Table (+ CSV / Pareto plot) of one or more suite JSONs measured with the same protocol and windows."""
    from kivi.eval import spec_kind
    from kivi.eval.sweep import pareto_plot, write_rows

    runs = [json.loads(Path(p).read_text()) for p in paths]
    d = runs[0]
    for other, p in zip(runs[1:], paths[1:]):
        if other["protocol"]["windows"] != d["protocol"]["windows"] or abs(other["fp"]["ppl"] - d["fp"]["ppl"]) > 1e-9:
            raise SystemExit(f"{p}: different windows or FP perplexity than {paths[0]}; not comparable")
    fp = dict(d["fp"], kind="fp", delta_ppl_pct=0.0, kl=0.0, top1_agreement=1.0)
    rows = [fp]
    seen = set()
    for r in (r for run in runs for r in run["results"]):
        if r["name"] in seen:
            continue
        seen.add(r["name"])
        spec = r["config"] if isinstance(r["config"], str) else KiviConfig.from_dict(r["config"])
        rows.append(dict(r, kind=spec_kind(spec)))
    if csv_path:
        write_rows(rows, csv_path)
    if plot:
        p = d["protocol"]
        pareto_plot(rows, plot, title=f"SmolLM2-135M-Instruct, WikiText-2: {p['windows']} windows x {p['context']} "
                                      f"tokens (prefix {p['prefix']}, chunk {p['chunk']})")
    print(f"{'name':28s} {'bits':>6s} {'bytes':>9s} {'ppl':>8s} {'dppl%':>7s} {'KL':>8s} {'top1%':>6s}")
    for r in rows:
        if r.get("unavailable"):
            print(f"{r['name']:28s} unavailable: {r['unavailable']}")
            continue
        print(f"{r['name']:28s} {r['bits_per_element']:6.2f} {r['cache_bytes']:9d} {r['ppl']:8.3f} "
              f"{r['delta_ppl_pct']:+7.2f} {r['kl']:8.4f} {100 * r['top1_agreement']:6.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="main", choices=sorted(suites()))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch and numba threads (1 is faster on a busy machine)")
    ap.add_argument("--out", default=None, help="JSON written after every batch of windows")
    ap.add_argument("--summarize", nargs="+", default=None,
                    help="instead of measuring: turn these JSON files (same protocol) into a table, --csv, --plot")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    if a.summarize:
        return summarize(a.summarize, a.csv, a.plot)
    if not a.out:
        ap.error("--out is required")
    model, tok = load_model(a.model)
    if a.threads:
        from kivi.attention.fused_cpu import fused_decode_available, warmup
        from kivi.cli.common import set_cpu_threads

        if fused_decode_available():
            warmup()  # loading the numba kernels later could reset torch's thread count to numba's
        set_cpu_threads(a.threads)
    windows = token_windows(tok, load_text(), a.context, a.windows)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": a.model, "text": "wikitext-2-raw-test (shipped)", "suite": a.suite,
            "torch_threads": torch.get_num_threads(), "command": " ".join(sys.argv)}

    def write(snap):
        out.write_text(json.dumps({**meta, **snap}, indent=2) + "\n")
        r = snap["results"]
        print(f"[{time.strftime('%H:%M:%S')}] windows {snap['protocol']['windows']}: fp ppl "
              f"{snap['fp']['ppl']:.3f}; " + "; ".join(
                  f"{x['name']}: {x.get('ppl', float('nan')):.3f}" for x in r), file=sys.stderr, flush=True)

    compare(model, windows, suites()[a.suite], prefix=a.prefix, chunk=a.chunk, batch_size=a.batch_size,
            on_window=write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
