"""What a person reads of a long-context run: a rich table and a plot (score vs length per config, and
score vs bits per element at the longest length)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def _fmt_diff(r: dict[str, Any]) -> str:
    if r.get("diff_vs_fp") is None:
        return ""
    if r.get("diff_ci_low") is None:
        return f"{r['diff_vs_fp']:+.1f} [n=1]"
    mark = " ~" if r["within_noise"] else ""
    return f"{r['diff_vs_fp']:+.1f} [{r['diff_ci_low']:+.1f}, {r['diff_ci_high']:+.1f}]{mark}"


def table(summary: Sequence[dict[str, Any]]) -> Any:
    """A ``rich.table.Table``: per (protocol, length, config) the average, its paired difference from FP,
    and each task's score (ties ``~``: the paired interval contains 0, within noise)."""
    from rich.table import Table  # noqa: PLC0415

    tasks = list(dict.fromkeys(r["task"] for r in summary if not r["task"].startswith("average")))
    t = Table(title="long-context suite: score (points, 0-100); Δ vs fp with its paired 95% interval, "
                    "~ = within noise")
    for col in ("protocol", "length", "config", "bits", "average [95%]", "Δ avg vs fp", *tasks):
        t.add_column(col, justify="left" if col in ("protocol", "config") else "right")
    keys = list(dict.fromkeys((r["protocol"], r["length"], r["config"]) for r in summary))
    for p, L, c in keys:
        rows = {r["task"]: r for r in summary if (r["protocol"], r["length"], r["config"]) == (p, L, c)}
        avg = rows.get("average") or next(iter(rows.values()))
        cells = [f"{rows[x]['score']:.1f}" + ("" if rows[x].get("fp_meaningful", True) else "*") if x in rows else ""
                 for x in tasks]
        ci = "" if avg["ci_low"] is None else f" [{avg['ci_low']:.1f}, {avg['ci_high']:.1f}]"
        t.add_row(p, str(L), c, f"{avg['bits_per_element']:.2f}", f"{avg['score']:.1f}{ci}", _fmt_diff(avg), *cells)
    t.caption = "* full precision scores at most 20 points on this task at this length: the model cannot do it"
    return t


def plot(summary: Sequence[dict[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """Two panels (PNG): the average score vs length per (config, protocol), and the average score vs bits
    per element at the longest length. Needs matplotlib (imported here)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or 'kivi[plot]')") from None
    avg = [r for r in summary if r["task"] == "average"] or list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5))
    for c in dict.fromkeys(r["config"] for r in avg):
        for p, style in (("question-after", "-o"), ("one-shot", "--s")):
            pts = sorted((r["length"], r["score"], r["ci_low"], r["ci_high"]) for r in avg
                         if r["config"] == c and r["protocol"] == p)
            if pts:
                xs = [x[0] for x in pts]
                a.plot(xs, [x[1] for x in pts], style, label=f"{c} ({p})")
                if all(x[2] is not None for x in pts):
                    a.fill_between(xs, [x[2] for x in pts], [x[3] for x in pts], alpha=0.1)
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt length (tokens)")
    a.set_ylabel("suite average score (points)")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    longest = max(r["length"] for r in avg)
    for r in (r for r in avg if r["length"] == longest):
        marker = "o" if r["protocol"] == "question-after" else "s"
        err = None if r["ci_low"] is None else [[r["score"] - r["ci_low"]], [r["ci_high"] - r["score"]]]
        b.errorbar(r["bits_per_element"], r["score"], yerr=err, fmt=marker, capsize=3)
        b.annotate(r["config"], (r["bits_per_element"], r["score"]), textcoords="offset points", xytext=(4, 4),
                   fontsize=7)
    b.set_xscale("log", base=2)
    b.set_xlabel(f"bits per cached element at {longest} tokens (real cache bytes)")
    b.set_ylabel("suite average score (points)")
    b.set_title(f"at {longest} tokens (o question-after, s one-shot)", fontsize=9)
    b.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


__all__ = ["plot", "table"]
