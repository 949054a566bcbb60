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


def attribution_table(result: dict[str, Any], *, limit: int = 12) -> Any:
    """A ``rich.table.Table`` of :func:`.attribution.attribute`'s ranking: the ``limit`` ablations that recover
    most of the lost samples' margin, with the samples each fixes (per task)."""
    from rich.table import Table  # noqa: PLC0415

    ok = sum(1 for s in result["samples"] if s["consistent"])
    t = Table(title=f"{result['config']}: {result['lost']} answers lost vs {result['fp']}, {ok} with consistent "
                    "margins; recovery = share of full precision's margin an ablation restores")
    tasks = sorted({s["task"] for s in result["samples"]})
    for col in ("ablation", "mean recovery", "fixed", *(f"fixed {x}" for x in tasks)):
        t.add_column(col, justify="left" if col == "ablation" else "right")
    for a in result["ablations"][:limit]:
        t.add_row(a["ablation"], f"{a['mean_recovery']:+.2f}", f"{a['fixed']}/{a['n']}",
                  *(str(a["fixed_by_task"].get(x, 0)) for x in tasks))
    if result["skipped"]:
        t.caption = f"{len(result['skipped'])} lost answers skipped (no single deciding token): see --json"
    return t


def _common_averages(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (config, length, protocol): the mean score and bits over the tasks that every config has at that
    (length, protocol), so that the points compare the same tasks (intervals: the table and the JSON)."""
    per = [r for r in summary if not r["task"].startswith("average")]
    out = []
    for p, L in dict.fromkeys((r["protocol"], r["length"]) for r in per):
        here = [r for r in per if (r["protocol"], r["length"]) == (p, L)]
        configs = list(dict.fromkeys(r["config"] for r in here))
        common = set.intersection(*({r["task"] for r in here if r["config"] == c} for c in configs))
        for c in configs:
            rs = [r for r in here if r["config"] == c and r["task"] in common]
            if rs:
                out.append({"config": c, "length": L, "protocol": p, "score": sum(r["score"] for r in rs) / len(rs),
                            "bits_per_element": sum(r["bits_per_element"] for r in rs) / len(rs)})
    return out


def plot(summary: Sequence[dict[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """Two panels (PNG): the average score vs length per (config, protocol), and the average score vs bits
    per element at the longest length; each average is over the tasks every config ran there
    (:func:`_common_averages`). Needs matplotlib (imported here)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or 'kivi[plot]')") from None
    avg = _common_averages(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5))
    configs = list(dict.fromkeys(r["config"] for r in avg))
    cmap = plt.get_cmap("tab10" if len(configs) <= 10 else "tab20")
    color = {c: cmap(i % cmap.N) for i, c in enumerate(configs)}  # one colour per config, both protocols
    for c in configs:
        for p, style in (("question-after", "-o"), ("one-shot", "--s")):
            pts = sorted((r["length"], r["score"]) for r in avg if r["config"] == c and r["protocol"] == p)
            if pts:
                a.plot([x[0] for x in pts], [x[1] for x in pts], style, color=color[c], label=f"{c} ({p})")
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt length (tokens)")
    a.set_ylabel("average over the tasks every config ran (points)")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=6.5, loc="center", ncol=2, framealpha=0.8)
    longest = max(r["length"] for r in avg)
    for r in (r for r in avg if r["length"] == longest):
        marker = "o" if r["protocol"] == "question-after" else "s"
        b.scatter(r["bits_per_element"], r["score"], marker=marker, color=color[r["config"]])
        b.annotate(r["config"], (r["bits_per_element"], r["score"]), textcoords="offset points", xytext=(4, 4),
                   fontsize=7)
    b.set_xscale("log", base=2)
    b.set_xlabel(f"bits per cached element at {longest} tokens (real cache bytes)")
    b.set_ylabel("average over the tasks every config ran (points)")
    b.set_title(f"at {longest} tokens (o question-after, s one-shot)", fontsize=9)
    b.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    from ...files import write_file

    p = Path(path)
    try:  # the one writer: a temporary name, then it replaces a regular file only
        write_file(p, lambda tmp: fig.savefig(tmp, dpi=120, format=p.suffix[1:].lower() or "png"))
    finally:
        plt.close(fig)
    return p


__all__ = ["plot", "table"]
