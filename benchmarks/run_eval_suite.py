#!/usr/bin/env python
"""Measure KIVI configs and baselines on SmolLM2 / WikiText-2 with the streaming protocol.

Protocol (default): windows of 1024 tokens, prefix 512, chunk 16. Results are written to
``--out`` (JSON) after every batch of windows, so a partial run is still usable.

    python benchmarks/run_eval_suite.py --suite main --windows 20 --out results/main.json
    python benchmarks/run_eval_suite.py --suite sensitivity --windows 4 --out results/sensitivity.json
    python benchmarks/run_eval_suite.py --suite clip --windows 20 --threads 1 --out results/clip12_suite.json
    python benchmarks/run_eval_suite.py --summarize a.json b.json --csv table.csv --plot pareto.png
    python benchmarks/run_eval_suite.py --suite weights --weight-bits 16,8,4 --windows 20 --batch-size 1 \
        --threads 1 --out results/weights_ppl.json

``--weight-bits 16,8,4`` loads one model per weight width (``kivi.models.quantize_weights``: optimum-quanto
qint8 / qint4 linear layers) and runs the suite on each, window by window (every width gets window
``i`` before any gets window ``i + 1``), so a run stopped early covers every width equally. Its JSON holds,
per width, the FP-cache (DynamicCache) and KIVI results summed over the windows done, the model's
measured weight bytes, and the per-window results.
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
from kivi.models import load_model, quantize_weights, weight_bytes


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
        # Issue 12 item 4: MSE-optimal clipping of group ranges (KiviConfig.clip) against the same configs
        # without it, same windows in the same run (docs/quality.md).
        "clip": [KiviConfig(sink_tokens=4), KiviConfig(sink_tokens=4, clip=True),
                 P("balanced"), P("balanced", clip=True)],
        # which side clipping helps or hurts, and plain KIVI-2 (no sinks: the screen's setting)
        "clipsides": [KiviConfig(sink_tokens=4, clip="keys"), KiviConfig(sink_tokens=4, clip="values"),
                      P("extreme"), P("extreme", clip=True)],
        "clipbalanced": [P("balanced", clip="keys"), P("balanced", clip="values")],
        # With --weight-bits 16,8,4: KIVI 2/2 (plain KIVI-2) and balanced on weight-quantized models.
        "weights": [P("extreme"), P("balanced")],
        # Issue 12's Pareto table: the KIVI references; the new configurations come as --configs files
        # (e.g. `kivi profile --per-head --first-window 20 --write-config ...`). quanto's rows (hours here:
        # its cache runs 16-token chunks) come from the `main` suite's 20-window file, same protocol.
        "pareto": [P("extreme"), KiviConfig(sink_tokens=4), P("balanced"), P("high")],
        "none": [],
    }


def merge_windows(snapshots: list[dict]) -> dict:
    """One ``compare`` result from results of ``compare`` on disjoint windows (same specs, same protocol).

    ``compare`` reports per-token means (``nll``, ``kl``, ``top1_agreement``) and per-window means (bits,
    bytes); they are re-weighted by ``tokens_scored`` / ``windows``, so the merge equals one ``compare``
    call over all the windows (``ppl = exp(total nll / total tokens)``).
    """
    import math

    def merge(rows: list[dict], fp_rows: list[dict] | None) -> dict:
        if any("unavailable" in r for r in rows):
            return next(r for r in rows if "unavailable" in r)
        tok = sum(r["tokens_scored"] for r in rows)
        win = sum(r["windows"] for r in rows)
        out = dict(rows[0])
        out.update(
            nll=sum(r["nll"] * r["tokens_scored"] for r in rows) / tok, tokens_scored=tok, windows=win,
            bits_per_element=sum(r["bits_per_element"] * r["windows"] for r in rows) / win,
            cache_bytes=int(sum(r["cache_bytes"] * r["windows"] for r in rows) / win),
            seconds=round(sum(r["seconds"] for r in rows), 2),
        )
        out["ppl"] = math.exp(out["nll"])
        if fp_rows is not None:
            fp = merge(fp_rows, None)
            out["ppl_fp"] = fp["ppl"]
            out["delta_ppl_pct"] = 100.0 * (out["ppl"] / fp["ppl"] - 1.0)
            out["kl"] = sum(r["kl"] * r["tokens_scored"] for r in rows) / tok
            out["top1_agreement"] = sum(r["top1_agreement"] * r["tokens_scored"] for r in rows) / tok
        return out

    fps = [s["fp"] for s in snapshots]
    proto = dict(snapshots[0]["protocol"])
    proto["windows"] = sum(s["protocol"]["windows"] for s in snapshots)
    proto["windows_requested"] = sum(s["protocol"]["windows_requested"] for s in snapshots)
    proto["seconds"] = round(sum(s["protocol"]["seconds"] for s in snapshots), 1)
    return {
        "protocol": proto,
        "fp": merge(fps, None),
        "results": [merge([s["results"][i] for s in snapshots], fps) for i in range(len(snapshots[0]["results"]))],
    }


def run_weight_bits(a, specs: list, bits_list: list[int], tok_windows: torch.Tensor, out: Path, meta: dict) -> None:
    """The suite on one model per weight width, window-major; JSON rewritten after every window."""
    models = {}
    for bits in bits_list:
        model, _ = load_model(a.model)
        models[bits] = quantize_weights(model, bits)
    per_window: dict[int, list[dict]] = {b: [] for b in bits_list}
    for w in range(0, tok_windows.shape[0], a.batch_size):
        ids = tok_windows[w : w + a.batch_size]
        for bits, model in models.items():
            per_window[bits].append(compare(model, ids, specs, prefix=a.prefix, chunk=a.chunk,
                                            batch_size=a.batch_size, progress=False))
        runs = {}
        for bits in bits_list:
            merged = merge_windows(per_window[bits])
            runs[str(bits)] = {"weight_bits": bits, "weight_bytes": weight_bytes(models[bits]), **merged,
                               "per_window": per_window[bits]}
        ref = runs[str(bits_list[0])]["fp"]["ppl"]
        for r in runs.values():  # perplexity against the first width's FP-cache model (the float one with 16 first)
            for x in [r["fp"], *r["results"]]:
                if "ppl" in x:
                    x[f"delta_ppl_pct_vs_w{bits_list[0]}_fp"] = 100.0 * (x["ppl"] / ref - 1.0)
        n = runs[str(bits_list[0])]["protocol"]["windows"]
        proto = {**runs[str(bits_list[0])]["protocol"], "windows": n, "windows_requested": int(tok_windows.shape[0])}
        out.write_text(json.dumps({**meta, "protocol": proto,
                                   "weights": runs}, indent=2) + "\n")
        print(f"[{time.strftime('%H:%M:%S')}] windows {n}: " + "; ".join(
            f"w{b}: fp {r['fp']['ppl']:.3f} " + " ".join(f"{x['name']} {x.get('ppl', float('nan')):.3f}" for x in r["results"])
            for b, r in runs.items()), file=sys.stderr, flush=True)


#: Issue 12's targets: (bits per element, Δppl %) -- <= +5 % at <= 3.3 bits, <= +0.5 % at <= 4.3 bits.
ISSUE12_GOALS = ((3.3, 5.0), (4.3, 0.5))


def bits_at_32k(model: str, cfg: KiviConfig) -> float:
    """Issue 12's bits per element: ``kivi estimate`` for a float16 model at 32K tokens, all bytes the
    cache holds (codes, scales, offsets, sinks, the window) over 2 x layers x kv heads x head_dim x tokens."""
    from kivi.eval.head_profile import bits_per_element

    return bits_per_element(model, cfg, 32768)  # ValueError: a config the model refuses


_MODELS: dict[str, object] = {}


def _nbytes_bits(model: str, spec, tokens: int | None) -> float | None:
    """Issue 12's bits per element from ``cache.nbytes`` of a real float16 cache after ``tokens`` tokens."""
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
              goals: tuple[tuple[float, float], ...] = ISSUE12_GOALS, extra_rows: list[str] | None = None,
              nbytes_tokens: int | None = None) -> int:
    """Table (+ CSV / Pareto plot) of one or more suite JSONs measured with the same protocol and windows.

    Rows of later files with a name already seen are skipped, and with ``extra_rows`` only the rows of
    later files named there are taken (e.g. quanto's rows of an older 20-window file); ``bits_32k`` is issue 12's convention
    (:func:`bits_at_32k`), next to the harness's ``bits_per_element`` (real bytes of each 1K window); with
    ``nbytes_tokens``, ``bits_nbytes`` is the same definition read from ``cache.nbytes`` of a real KIVI cache
    after one float16 prefill of that many random tokens (kivi.eval.caches.synthetic_bits: no forward)."""
    from kivi.eval import spec_kind
    from kivi.eval.sweep import pareto_plot, write_rows

    runs = [json.loads(Path(p).read_text()) for p in paths]
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
                    x_key="bits_32k", x_label="bits/element, issue 12: kivi estimate, float16 model, 32K tokens "
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="main", choices=sorted(suites()))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--configs", nargs="+", default=[], metavar="JSON",
                    help="KiviConfig JSON files measured after the suite's rows, in the same run (--suite none: only these)")
    ap.add_argument("--weight-bits", default="16",
                    help="comma-separated weight widths, e.g. 16,8,4 (8/4: optimum-quanto qint8/qint4 weights)")
    ap.add_argument("--threads", type=int, default=None, help="torch and numba threads (1 is faster on a busy machine)")
    ap.add_argument("--out", default=None, help="JSON written after every batch of windows")
    ap.add_argument("--summarize", nargs="+", default=None,
                    help="instead of measuring: turn these JSON files (same protocol) into a table, --csv, --plot")
    ap.add_argument("--extra-rows", nargs="+", default=None, metavar="NAME",
                    help="with --summarize: take only these rows from the files after the first")
    ap.add_argument("--nbytes-tokens", type=int, default=None, metavar="TOKENS",
                    help="with --summarize: also bits per element from cache.nbytes after a float16 prefill of this "
                         "many tokens (e.g. 32768, issue 12's context)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--goal", type=parse_goal, action="append", default=None, metavar="BITS:PCT",
                    help="a target drawn on --plot (repeatable; default: issue 12's 3.3:5 and 4.3:0.5)")
    a = ap.parse_args()
    if a.summarize:
        return summarize(a.summarize, a.csv, a.plot, tuple(a.goal) if a.goal else ISSUE12_GOALS, a.extra_rows, a.nbytes_tokens)
    if not a.out:
        ap.error("--out is required")
    try:
        bits_list = [int(x) for x in a.weight_bits.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--weight-bits {a.weight_bits!r}: expected comma-separated integers such as 16,8,4")
    specs = suites()[a.suite] + [KiviConfig.from_json(f) for f in a.configs]
    if not specs:
        ap.error("nothing to measure: --suite none needs --configs")
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
    meta = {"model": a.model, "text": "wikitext-2-raw-test (shipped)", "suite": a.suite, "configs": a.configs,
            "torch_threads": torch.get_num_threads(), "command": " ".join(sys.argv)}
    if bits_list != [16]:
        del model
        run_weight_bits(a, specs, bits_list, windows, out, meta)
        return 0

    def write(snap):
        out.write_text(json.dumps({**meta, **snap}, indent=2) + "\n")
        r = snap["results"]
        print(f"[{time.strftime('%H:%M:%S')}] windows {snap['protocol']['windows']}: fp ppl "
              f"{snap['fp']['ppl']:.3f}; " + "; ".join(
                  f"{x['name']}: {x.get('ppl', float('nan')):.3f}" for x in r), file=sys.stderr, flush=True)

    compare(model, windows, specs, prefix=a.prefix, chunk=a.chunk, batch_size=a.batch_size,
            on_window=write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
