"""Reports of a sweep: the CSV rows and the Pareto plot, written by the one writer (:mod:`kivi.files`)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Sequence

from ..files import write_file, write_text

ROW_FIELDS = ("name", "kind", "bits_per_element", "cache_bytes", "ppl", "delta_ppl_pct", "kl", "top1_agreement",
              "tokens_scored", "windows", "passkey_accuracy", "unavailable", "config")



def write_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as CSV (``.csv``) or JSON (anything else)."""
    p = Path(path)
    if p.suffix.lower() == ".csv":
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=list(ROW_FIELDS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(r[k]) if k == "config" and isinstance(r.get(k), dict) else r.get(k))
                        for k in ROW_FIELDS})
        write_text(p, buf.getvalue())
    else:
        write_text(p, json.dumps(list(rows), indent=2, default=str) + "\n")
    return p




def pareto_plot(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str | None = None,
                goals: Sequence[tuple[float, float]] = (), x_key: str = "bits_per_element",
                x_label: str = "bits per cached element (real cache bytes, incl. scales and FP window)") -> Path:
    """Δppl % vs bits per element (PNG). Presets are stars, baselines squares, FP a diamond; the
    Pareto front of the KIVI configs is drawn as a line. ``goals``: ``(max bits, max Δppl %)`` targets,
    each drawn as the corner of the region that meets it (below and left). ``x_key``: the row field on
    the x axis (rows without it fall back to ``bits_per_element``). Needs matplotlib (imported here)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or 'kivi[plot]')") from None
    pts = [r for r in rows if not r.get("unavailable") and r.get("delta_ppl_pct") is not None]
    pts = [dict(r, bits_per_element=r[x_key] if r.get(x_key) is not None else r["bits_per_element"]) for r in pts]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {"fp": ("D", "black"), "baseline": ("s", "tab:red"), "kivi": ("o", "tab:blue")}
    for r in pts:
        kind = r.get("kind", "kivi")
        marker, color = ("*", "tab:green") if kind.startswith("preset") else styles.get(kind, ("o", "tab:blue"))
        ax.scatter(r["bits_per_element"], r["delta_ppl_pct"], marker=marker, color=color,
                   s=160 if marker == "*" else 50, zorder=3)
        label = kind.split(":", 1)[1] if kind.startswith("preset") else r["name"]
        ax.annotate(label, (r["bits_per_element"], r["delta_ppl_pct"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    kivi = sorted((r for r in pts if r.get("kind", "kivi") in ("kivi",) or str(r.get("kind")).startswith("preset")),
                  key=lambda r: (r["bits_per_element"], r["delta_ppl_pct"]))
    front, best = [], math.inf
    for r in kivi:
        if r["delta_ppl_pct"] < best:
            front.append(r)
            best = r["delta_ppl_pct"]
    if len(front) > 1:
        ax.plot([r["bits_per_element"] for r in front], [r["delta_ppl_pct"] for r in front], "--", color="tab:blue",
                alpha=0.6, label="KIVI Pareto front")
    for k, (m, c) in (("KIVI config", ("o", "tab:blue")), ("preset", ("*", "tab:green")),
                      ("baseline (quanto)", ("s", "tab:red")), ("FP (DynamicCache)", ("D", "black"))):
        ax.scatter([], [], marker=m, color=c, label=k)
    left = min([r["bits_per_element"] for r in pts] + [g[0] for g in goals] + [1.0]) / 1.3
    for i, (gb, gp) in enumerate(goals):
        ax.plot([left, gb, gb], [gp, gp, -0.5], ":", color="tab:purple", alpha=0.8,
                label="goal" if i == 0 else None, zorder=2)
        ax.annotate(f"goal: \u2264{gp:+g}% at \u2264{gb:g} b", (gb, gp), textcoords="offset points", xytext=(3, -10),
                    fontsize=7, color="tab:purple")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    ax.set_ylabel("Δ perplexity vs FP (%)")
    ax.set_yscale("symlog", linthresh=1.0)
    lo = min([r["delta_ppl_pct"] for r in pts] + [0.0])
    ax.set_ylim(bottom=min(-0.5, 1.5 * lo))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    p = Path(path)
    fmt = p.suffix[1:].lower() or "png"  # given explicitly: the bytes go to a temporary name first
    try:
        write_file(p, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt))
    finally:
        plt.close(fig)
    return p

